"""elastictrain: fault-tolerant, elastic training for PyTorch.

The names below are imported on first use (PEP 562), so ``elastictrain --help``, a config error
or ``elastictrain snapshots list`` answer without waiting seconds for torch to import.

Under torchrun, importing the package ends a restarted worker at once when an earlier attempt met
an error no restart can fix (fatal.py): before torch, the config or any restore.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import excepthook  # noqa: F401  (installs the one-line hook for user errors: excepthook.py)
from .fatal import stop_if_an_earlier_attempt_failed
from .threads import prepare_environment

stop_if_an_earlier_attempt_failed()  # under torchrun: a later attempt that would only fail the same way

__version__ = "0.1.0"

prepare_environment()  # before anything calls MKL (elastictrain/threads.py)

_EXPORTS = {
    "Config": "config", "load_config": "config",
    "ConfigError": "errors", "DistributedSetupError": "errors", "ElastictrainError": "errors", "UsageError": "errors",
    "PeerLost": "errors", "SnapshotError": "errors", "StorageError": "errors", "StorageUnavailable": "errors",
    "RunSummary": "summary", "Session": "session", "StepRunner": "step_runner", "Trainer": "loop",
    "Observer": "events",
    "Preempted": "signals", "PREEMPTED_EXIT_CODE": "signals",
    "State": "states",
    "Task": "task",
}

__all__ = sorted([*_EXPORTS, "seed_everything"])


def __getattr__(name: str) -> Any:
    if name == "seed_everything":
        return importlib.import_module(".rng", __name__).seed_rng
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
