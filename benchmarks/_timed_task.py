"""Task factories for benchmarks/recovery.py: elastictrain's tasks, with a timestamped line when the factory starts and ends.

``python -m elastictrain train`` logs nothing before its process group is up, so these lines
split a restarted worker's start-up into imports (process start -> factory called), building the
task (model, optimizer, data: the first optimizer imports ``torch._dynamo``) and the rest. Lines
are ``timed-task rank R restart A t=<unix s> factory-start pid P`` and ``... factory-end`` on
stdout; the pid tells the benchmark which process to kill, however the launcher started it.
"""

from __future__ import annotations

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
