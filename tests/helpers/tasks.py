"""Test tasks: the built-in spirals task, small, with its sample order traced and a pause point for kills.

A test that kills a worker needs the kill to land at a known step: the traced loss function
writes its pid to a file and waits when it reaches ``pause_at_step`` on ``pause_rank``, the
first time only (the pid file marks that it happened), so the test's SIGKILL hits that step. A
test that sends a catchable signal instead lets the step go on by creating the ``.resume``
file next to the pid file. ``raise_rank``/``raise_at_step`` make a worker raise (a user bug),
once per job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from elastictrain import Task
from elastictrain.tasks import spirals


class IndexedDataset(Dataset):
    """Each sample also carries its index, so tests can see which samples each step used."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        return (*self.inner[index], index)


def build(trace_dir: str, pause_rank: int = -1, pause_at_step: int = -1, raise_rank: int = -1, raise_at_step: int = -1,
          **spiral_args) -> Task:
    spiral_args = {"train_samples": 1536, "val_samples": 512, "hidden": 64, "lr_step": 100, **spiral_args}
    task = spirals.build(**spiral_args)
    rank = os.environ.get("RANK", "0")
    # One trace file per process, named so that sorting by name sorts by start time.
    trace_path = Path(trace_dir) / f"rank{rank}-{time.time_ns()}-pid{os.getpid()}.jsonl"
    pause_marker = Path(trace_dir) / f"paused-rank{pause_rank}.pid"
    raise_marker = Path(trace_dir) / f"raised-rank{raise_rank}"
    calls = 0

    def traced_loss(model: torch.nn.Module, batch):
        nonlocal calls
        if model.training:
            calls += 1
            with trace_path.open("a") as trace:
                trace.write(json.dumps({"call": calls, "indices": batch[2].tolist()}) + "\n")
            if str(pause_rank) == rank and calls == pause_at_step and not pause_marker.exists():
                pause_marker.write_text(str(os.getpid()))
                resume = pause_marker.with_suffix(".resume")
                deadline = time.monotonic() + 600
                while not resume.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)  # the test SIGKILLs or signals this process here
            if str(raise_rank) == rank and calls == raise_at_step and not raise_marker.exists():
                raise_marker.touch()
                raise ValueError(f"a bug in the user's loss function at step {calls}")
        return spirals.cross_entropy_with_accuracy(model, batch)

    trace_path.touch()
    task.train_data = IndexedDataset(task.train_data)
    task.val_data = IndexedDataset(task.val_data)
    task.loss_fn = traced_loss
    return task


def read_traces(trace_dir: Path, rank: int) -> list[list[list[int]]]:
    """Per process of ``rank``, in start order: the sample indices of each training forward."""
    files = sorted(Path(trace_dir).glob(f"rank{rank}-*.jsonl"))
    return [[json.loads(line)["indices"] for line in f.read_text().splitlines()] for f in files]


def stitch(attempts: list[list[list[int]]], start_steps: list[int]) -> list[list[int]]:
    """The samples that count: each attempt continues from the step it restored, dropping redone steps."""
    assert len(attempts) == len(start_steps), (len(attempts), start_steps)
    steps: list[list[int]] = []
    for trace, start in zip(attempts, start_steps, strict=True):
        steps = steps[:start] + trace
    return steps
