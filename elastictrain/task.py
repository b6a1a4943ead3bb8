"""What a user hands to elastictrain: the components of one training task, and the factory import."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from .config import TaskConfig
from .errors import ConfigError

# loss_fn(model, batch) returns the mean loss over the batch, optionally with a dict of
# per-batch means of other metrics: `loss` or `(loss, {"accuracy": acc})`.
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, dict[str, Any]]"]


@dataclass
class Task:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Dataset
    loss_fn: LossFn
    val_data: Dataset | None = None
    lr_scheduler: Any = None  # any torch LR scheduler (state_dict/load_state_dict/step)
    grad_scaler: Any = None  # torch.amp.GradScaler
    collate_fn: Callable | None = None


def split_loss(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Normalise what a loss_fn returned into (loss, metrics)."""
    if isinstance(output, torch.Tensor):
        return output, {}
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict):
        return output[0], output[1]
    raise TypeError(f"loss_fn must return a loss tensor or (loss, metrics_dict), not {type(output).__name__}")


def load_task(cfg: TaskConfig) -> Task:
    """Import ``pkg.module:function`` and call it with ``task.args``; it must return a Task."""
    module_name, sep, function_name = cfg.factory.partition(":")
    if not sep or not module_name or not function_name:
        raise ConfigError(f"task.factory={cfg.factory!r} must be an import path of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"task.factory={cfg.factory!r}: cannot import {exc.name!r}; is it installed or on PYTHONPATH?") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ConfigError(f"task.factory={cfg.factory!r}: module {module_name!r} has no function {function_name!r}")
    try:
        task = factory(**cfg.args)
    except TypeError as exc:
        if "argument" in str(exc) and exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
            raise ConfigError(f"task.args do not fit {cfg.factory}: {exc}") from None
        raise
    if not isinstance(task, Task):
        raise ConfigError(f"task.factory={cfg.factory!r} returned {type(task).__name__}, expected elastictrain.Task")
    return task
