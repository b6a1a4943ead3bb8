"""Streaming (iterable) training data: exact resume under real torchrun, and one clear line for streams
that cannot be resumed.

The stream's shards are uneven (1537 samples over 2 ranks): every epoch ends for both ranks when
rank 1's 768 samples run out, with no rank left waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from torch.utils.data import IterableDataset

from elastictrain import ConfigError, Trainer, seed_everything
from elastictrain.train.tasks import spirals
from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.jobs import TIMEOUT_S, launch_job, start_steps
from tests.helpers.tasks import read_traces, stitch

# 768 samples per rank in batches of 16: 48 steps an epoch; 3 epochs end the run before max_steps.
STREAM = ["task.factory=tests.helpers.tasks:build_stream", "train.max_steps=1000", "train.max_epochs=3"]


@pytest.mark.torchrun
def test_a_stream_killed_mid_epoch_resumes_bitwise_with_every_sample_once(tmp_path):
    (tmp_path / "ref").mkdir()
    reference = launch_job(tmp_path / "ref", "job", STREAM)
    # The faulted job runs beside the reference (directories of their own); its kill waits for its pause.
    same_command = [*STREAM, "task.args.pause_rank=1", "task.args.pause_at_step=70"]
    job = launch_job(tmp_path, "job", same_command)
    assert reference.wait(TIMEOUT_S) == 0, reference.output()[-4000:]
    ref = parse_job(reference.output())
    assert ref.summary["step"] == "144" and ref.summary["epoch"] == "3"
    ref_traces = {rank: read_traces(tmp_path / "ref" / "trace", rank)[0] for rank in (0, 1)}
    for rank in (0, 1):  # each epoch: this rank's share once, its odd sample out dropped on rank 0
        assert len(ref_traces[rank]) == 144 and len({i for b in ref_traces[rank][:48] for i in b}) == 768

    os.kill(int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)), signal.SIGKILL)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    assert start_steps(output) == [0, 50]  # the snapshot of step 50, in epoch 1
    assert parse_job(output).summary["params_sha256"] == ref.summary["params_sha256"]
    for rank in (0, 1):
        assert stitch(read_traces(tmp_path / "trace", rank), [0, 50]) == ref_traces[rank]


class NoState(IterableDataset):
    def __iter__(self):
        yield from spirals.make_spirals(64, 3, 0.1, 0)


def fit_stream(dataset, **config):
    seed_everything(0)
    task = spirals.build(train_samples=64, val_samples=32, hidden=8)
    return Trainer(task.model, task.optimizer, dataset, task.loss_fn, config={
        "snapshot": {"durable": {"url": f"memory://streams/{uuid.uuid4().hex}"}}, "log": {"plots": False}, **config}).fit()


def test_a_stream_without_state_dict_is_one_clear_line():
    with pytest.raises(ConfigError, match=r"train_data is an IterableDataset \(NoState\) without state_dict\(\) and "
                                          r"load_state_dict\(\): its position cannot be saved"):
        fit_stream(NoState(), train={"max_steps": 5})


def test_a_stream_needs_max_steps_and_no_worker_processes():
    from tests.helpers.tasks import SpiralStream

    stream = SpiralStream(spirals.make_spirals(64, 3, 0.1, 0))
    with pytest.raises(ConfigError, match="must be given: set train.max_steps"):
        fit_stream(stream)
    with pytest.raises(ConfigError, match="data.num_workers=2: its position would live in the worker processes"):
        fit_stream(stream, train={"max_steps": 5}, data={"num_workers": 2})
