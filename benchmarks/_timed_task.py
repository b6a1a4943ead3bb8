"""Task factories for benchmarks/recovery.py: elastictrain's tasks, with a timestamped line when the factory starts and ends.

``python -m elastictrain train`` logs nothing before its process group is up, so these lines
split a restarted worker's start-up into imports (process start -> factory called), building the
task (model, optimizer, data: the first optimizer imports ``torch._dynamo``) and the rest. Lines
are ``timed-task rank R restart A t=<unix s> factory-start pid P`` and ``... factory-end`` on
stdout; the pid tells the benchmark which process to kill, however the launcher started it.

``spirals_raising`` is ``spirals`` whose ``loss_fn`` raises on rank 1 of the first attempt at the step
``TIMED_TASK_RAISE_AT`` names (a user's bug or a bad batch that fails one rank), after a line
``... raising`` whose time the benchmark counts from.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

from elastictrain import Task
from elastictrain.train.tasks import spirals as spirals_task

from benchmarks import _big_task


def _event(what: str) -> None:
    # Benchmark code: the rank and restart come from torchrun's variables directly.
    rank, restart = os.environ.get("RANK", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    sys.stdout.write(f"timed-task rank {rank} restart {restart} t={time.time():.3f} {what}\n")  # one write: no interleaving
    sys.stdout.flush()


def _timed(build: Callable[..., Task], kwargs: dict[str, Any]) -> Task:
    _event(f"factory-start pid {os.getpid()}")
    task = build(**kwargs)
    _event("factory-end")
    return task


def spirals(**kwargs: Any) -> Task:
    return _timed(spirals_task.build, kwargs)


def big(**kwargs: Any) -> Task:
    return _timed(_big_task.build, kwargs)


def spirals_raising(**kwargs: Any) -> Task:
    task = spirals(**kwargs)
    raise_at = int(os.environ["TIMED_TASK_RAISE_AT"])
    raises = os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    calls = [0]
    loss_fn = task.loss_fn

    def raising(model: Any, batch: Any) -> Any:
        calls[0] += 1  # one call a step (no accumulation), from step 1 in the first attempt
        if raises and calls[0] == raise_at:
            _event("raising")
            raise RuntimeError(f"benchmark: rank 1 raises at step {raise_at}")
        return loss_fn(model, batch)

    return dataclasses.replace(task, loss_fn=raising)
