"""elastictrain: fault-tolerant, elastic training for PyTorch.

The names below are imported on first use (PEP 562), so ``elastictrain --help``, a config error
or ``elastictrain snapshots list`` answer without waiting seconds for torch to import.

Under torchrun, importing the package ends a restarted worker at once when an earlier attempt met
an error no restart can fix (fatal.py): before torch, the config or any restore.
"""

from __future__ import annotations

import importlib
from typing import Any

from elastictrain.core import excepthook  # noqa: F401  (installs the one-line hook for user errors: excepthook.py)
from elastictrain.core.fatal import stop_if_an_earlier_attempt_failed
from elastictrain.core.threads import prepare_environment

stop_if_an_earlier_attempt_failed()  # under torchrun: a later attempt that would only fail the same way

__version__ = "0.1.0"

prepare_environment()  # before anything calls MKL (elastictrain/core/threads.py)

_EXPORTS = {
    "Config": "core.config",
    "load_config": "core.config_load",
    "ConfigError": "core.errors",
    "DistributedSetupError": "core.errors",
    "ElastictrainError": "core.errors",
    "UsageError": "core.errors",
    "PeerLost": "core.errors",
    "SnapshotError": "core.errors",
    "StorageError": "core.errors",
    "StorageUnavailable": "core.errors",
    "RunSummary": "train.summary",
    "Session": "train.session",
    "StepRunner": "train.step_runner",
    "Trainer": "train.trainer",
    "Task": "train.task",
    "Observer": "core.events",
    "State": "core.states",
    "Preempted": "core.signals",
    "PREEMPTED_EXIT_CODE": "core.signals",
}

__all__ = sorted([*_EXPORTS, "seed_everything"])


def __getattr__(name: str) -> Any:
    if name == "seed_everything":
        return importlib.import_module(".core.rng", __name__).seed_rng
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
