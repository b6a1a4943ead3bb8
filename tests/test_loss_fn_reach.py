"""A loss_fn that reaches into the model (``model.G(x)``) trains the same on one worker and under DDP.

Two-part models (a generator and a discriminator, an encoder and a head) are often called part by
part in the loss. Under DDP the loop's model was the DDP wrapper, which has no ``G``; and calling
the inner module's parts would skip DDP's gradient all-reduce. The loop now runs loss_fn inside
DDP's forward (``ddp.LossForward``): loss_fn always gets the user's module, and the gradients it
makes are synced. Checked on the numbers: a loss_fn calling the parts ends with the very
parameters of one calling ``model(x)``, on one worker and on two under real torchrun, and under
torchrun both ranks see the same parameters at every step (unsynced gradients would split them).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from elastictrain.snapshot.format import params_sha256
from elastictrain.train.task import Task
from elastictrain.train.tasks.spirals import make_spirals
from tests.conftest import job_env, parse_job, python_command, torchrun_command
from tests.helpers import procs

pytestmark = pytest.mark.slow  # a worker process per run, two runs per test


class TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(2, 16), nn.Tanh())
        self.D = nn.Linear(16, 3)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.D(self.G(points))


def through_forward(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def through_parts(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model.D(model.G(batch[0])), batch[1])


def traced(loss_fn, trace_dir: str, model: nn.Module, batch) -> torch.Tensor:
    """loss_fn, after appending the parameters this rank's model has at this step to its trace."""
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    with open(Path(trace_dir) / f"rank-{rank}", "a") as trace:
        trace.write(params_sha256(model) + "\n")
    return loss_fn(model, batch)


def build(reach: str, trace_dir: str) -> Task:
    model = TwoParts()
    loss_fn = {"forward": through_forward, "parts": through_parts}[reach]
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=make_spirals(256, 3, 0.1, seed=3), loss_fn=functools.partial(traced, loss_fn, trace_dir))


def launch(tmp_path: Path, reach: str, workers: int) -> procs.Launched:
    trace_dir = tmp_path / f"trace-{reach}"
    trace_dir.mkdir()
    overrides = [f"task.factory={__name__}:build", f"task.args.reach={reach}", f"task.args.trace_dir={trace_dir}",
                 "train.max_steps=6", "train.batch_size=16", f"run.dir={tmp_path / reach}", "log.plots=false"]
    command = python_command(overrides) if workers == 1 else torchrun_command(overrides, nproc=workers, max_restarts=0)
    return procs.launch(command, log_path=tmp_path / f"{reach}.log", env={**job_env(), "OMP_NUM_THREADS": "1"},
                        cwd=tmp_path)


def final_params(tmp_path: Path, reach: str, job: procs.Launched, workers: int) -> tuple[str, list[list[str]]]:
    """The run's final params_sha256, and each rank's parameters at every step."""
    assert job.wait(120) == 0, job.output()[-4000:]
    traces = [(tmp_path / f"trace-{reach}" / f"rank-{rank}").read_text().split() for rank in range(workers)]
    return parse_job(job.output()).summary["params_sha256"], traces


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.torchrun)])
def test_a_loss_fn_calling_the_models_parts_trains_as_one_calling_the_model(tmp_path, workers):
    # The two runs side by side (directories of their own, one intra-op thread per process).
    jobs = {reach: launch(tmp_path, reach, workers) for reach in ("parts", "forward")}
    parts, parts_traces = final_params(tmp_path, "parts", jobs["parts"], workers)
    forward, _ = final_params(tmp_path, "forward", jobs["forward"], workers)
    assert parts == forward
    assert len(parts_traces[0]) == 6
    assert all(trace == parts_traces[0] for trace in parts_traces)  # synced: every rank steps to the same weights
