"""Random augmentation in DataLoader worker processes survives a SIGKILL mid-epoch bitwise.

The dataset jitters every point with ``torch.randn`` in ``__getitem__`` and two worker
processes per rank fetch it. The resumed attempt starts new workers at another batch of the
epoch; the numbers of each sample must not change with it.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.jobs import TIMEOUT_S, launch_job, start_steps
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun

# One epoch of 48 steps, snapshots every 25: a kill at step 35 resumes at 25, mid-epoch.
JITTERED = ["task.factory=tests.helpers.tasks:build_jittered", "data.num_workers=2", "train.max_epochs=1"]


def test_a_run_with_random_augmentation_in_workers_killed_mid_epoch_ends_bitwise(tmp_path):
    (tmp_path / "ref").mkdir()
    reference = launch_job(tmp_path / "ref", "job", JITTERED)
    # The faulted job runs beside the reference (directories of their own); its kill waits for its pause.
    job = launch_job(tmp_path, "job", [*JITTERED, "task.args.pause_rank=1", "task.args.pause_at_step=35"])
    assert reference.wait(TIMEOUT_S) == 0, reference.output()[-4000:]
    ref = parse_job(reference.output())
    assert ref.summary["step"] == "48"

    os.kill(int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)), signal.SIGKILL)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    assert start_steps(output) == [0, 25]
    for rank in (0, 1):  # the same samples in the same order: only their augmentation could differ
        reference_trace = read_traces(tmp_path / "ref" / "trace", rank)[0]
        assert stitch(read_traces(tmp_path / "trace", rank), [0, 25]) == reference_trace
    assert parse_job(output).summary["params_sha256"] == ref.summary["params_sha256"]
