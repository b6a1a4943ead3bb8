"""What a user hands to elastictrain: the components of one training task, and the factory import."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import torch
from torch import nn
from torch.utils.data import Dataset

from elastictrain.core.config import TaskConfig, redact_secrets
from elastictrain.core.errors import TRACEBACK_ENV, ConfigError, LossFnError, UsageError, one_line, tracebacks_wanted
from elastictrain.data.sampling import check_dataset

# loss_fn(model, batch) returns the mean loss over the batch, optionally with a dict of
# per-batch means of other metrics: `loss` or `(loss, {"accuracy": acc})`.
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, dict[str, Any]]"]


@dataclass
class Task:
    """The components of one training task, as ``Trainer`` takes them and a ``task.factory`` returns them.

    ``loss_fn(model, batch)`` returns the batch's mean loss, or ``(loss, {"accuracy": acc})`` with
    per-batch means of other metrics. ``lr_scheduler`` is a scheduler or a factory
    ``(optimizer, total_steps) -> scheduler``. A list of optimizers, a dataset that is not one or a
    factory that cannot be called so is one ``ConfigError`` when the task is built.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_data: Dataset
    loss_fn: LossFn
    val_data: Dataset | None = None
    lr_scheduler: Any = None  # any torch LR scheduler (state_dict/load_state_dict/step)
    grad_scaler: Any = None  # torch.amp.GradScaler
    collate_fn: Callable | None = None

    def __post_init__(self) -> None:
        check_dataset(self.train_data, "train_data")
        if self.val_data is not None:
            check_dataset(self.val_data, "val_data")
        if callable(self.lr_scheduler) and not hasattr(self.lr_scheduler, "state_dict"):
            check_scheduler_factory(self.lr_scheduler)
        if isinstance(self.optimizer, (list, tuple, dict)):
            # Checked here, where the Trainer is built, not at step 0 as a traceback from optimizer.step().
            raise ConfigError(
                f"optimizer is a {type(self.optimizer).__name__} of {len(self.optimizer)}; the Trainer steps one "
                "torch.optim.Optimizer: put the parameter groups in one optimizer (each group may have its own lr), "
                "or train the several optimizers in a custom loop"
            )


def check_scheduler_factory(factory: Callable) -> None:
    """A scheduler factory is called as ``factory(optimizer, total_steps)``: one that cannot be is one line now, not a
    TypeError once the run has restored."""
    try:
        inspect.signature(factory).bind(None, 0)
    except TypeError:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise UsageError(
            f"lr_scheduler {name}{inspect.signature(factory)} cannot be called as factory(optimizer, total_steps): a "
            "scheduler factory takes both, e.g. lambda optimizer, total_steps: CosineAnnealingLR(optimizer, "
            "T_max=total_steps); or pass a built scheduler"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass


class PendingScheduler:
    """Stands in for an LR scheduler that a factory builds once the run's step count is known.

    The step count depends on the global batch, which a restart at another world size reads from
    the snapshot: so the snapshot is loaded first (this keeps its scheduler state), then ``build``
    calls the factory and hands the scheduler that state.
    """

    def __init__(self, factory: Callable[[torch.optim.Optimizer, int], Any], optimizer: torch.optim.Optimizer) -> None:
        self.factory = factory
        self.optimizer = optimizer  # also how the session pairs it with its optimizer before it is built
        self.saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the LR scheduler factory was never called: build() comes before the first snapshot")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved = state_dict

    def build(self, total_steps: int) -> Any:
        optimizer = self.optimizer
        restored_lrs = [group["lr"] for group in optimizer.param_groups]
        scheduler = self.factory(optimizer, total_steps)
        if self.saved is not None:
            scheduler.load_state_dict(self.saved)
            # A new scheduler sets the LR of its first step; the restored optimizer's is the one to go on with.
            for group, lr in zip(optimizer.param_groups, restored_lrs):
                group["lr"] = lr
        return scheduler


LOSS_FN_RULE = 'loss_fn must return a scalar loss tensor, or (loss, {"name": scalar})'


def split_loss(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Normalise what a loss_fn returned into (loss, metrics); anything else is one LossFnError naming it.

    Checked at every call, because it is cheap: type checks and ``numel()`` read metadata only,
    never the values, so no device sync (about a microsecond a step, against milliseconds).
    """
    metrics: dict[str, Any]
    if isinstance(output, torch.Tensor):
        loss, metrics = output, {}
    elif isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict):
        loss, metrics = output
    else:
        raise LossFnError(_not_a_loss(output))
    if not isinstance(loss, torch.Tensor):
        raise LossFnError(
            f"loss_fn returned a loss of type {type(loss).__name__}; the loss must be a scalar tensor that "
            "backward() can reach (the tensor itself, not loss.item() or a number)"
        )
    if loss.numel() != 1:
        raise LossFnError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)}; the loss must be a scalar, the mean over the "
            "batch: return loss.mean() (or reduction='mean' in the loss function)"
        )
    for name, value in metrics.items():
        if not is_scalar(value):
            raise LossFnError(_not_a_scalar_metric(name, value))
    if "loss" in metrics:
        raise LossFnError("loss_fn returned a metric named 'loss', which would hide the loss; rename the metric")
    return loss, metrics


def is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return True
    shape = getattr(value, "shape", None)  # a numpy array
    return isinstance(shape, tuple) and math.prod(shape) == 1


def _not_a_scalar_metric(name: str, value: Any) -> str:
    shape = getattr(value, "shape", None)
    given = f"of shape {tuple(shape)}" if shape is not None else f"of type {type(value).__name__}"
    return (
        f"loss_fn returned metric {name!r} {given}; metrics must be scalars, the mean over the batch: "
        f"return {{{name!r}: x.mean()}}"
    )


def _not_a_loss(output: Any) -> str:
    if isinstance(output, tuple):
        given = f"a tuple ({', '.join(type(item).__name__ for item in output)})"
    else:
        given = "None" if output is None else type(output).__name__
    hint = ""
    if hasattr(output, "loss"):  # a Hugging Face ModelOutput, or any object carrying its loss
        hint = "; did you mean to return output.loss?"
        if output.loss is None:
            hint += " (it is None here: the model computes a loss only when the batch holds labels)"
    elif isinstance(output, dict) and "loss" in output:
        hint = "; did you mean to return output['loss']?"
    elif output is None:
        hint = "; does loss_fn end with a return statement?"
    elif isinstance(output, numbers.Real):
        hint = "; return the loss tensor itself, not loss.item() or a number"
    return f"loss_fn returned {given}: {LOSS_FN_RULE}{hint}"


def load_task(cfg: TaskConfig) -> Task:
    """Import ``pkg.module:function`` and call it with ``task.args``; it must return a Task."""
    module_name, sep, function_name = cfg.factory.partition(":")
    if not sep or not module_name or not function_name:
        raise ConfigError(f"task.factory={cfg.factory!r} must be an import path of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"task.factory={cfg.factory!r}: cannot import {exc.name!r}; is it installed or on PYTHONPATH?"
        ) from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ConfigError(f"task.factory={cfg.factory!r}: module {module_name!r} has no function {function_name!r}")
    _check_arg_types(factory, cfg)
    try:
        task = factory(**cfg.args)
    except (TypeError, ValueError) as exc:
        if tracebacks_wanted() or not _concerns_args(exc, cfg.args):
            raise
        message = one_line(exc, 300, kind=True)
        given = ", ".join(f"{name}={_short_repr(value)}" for name, value in redact_secrets(cfg.args).items())
        raise ConfigError(
            f"task.args do not fit {cfg.factory} (given {given}): {message}; "
            f"fix task.args (for the traceback: {TRACEBACK_ENV}=1)"
        ) from None
    if not isinstance(task, Task):
        raise ConfigError(f"task.factory={cfg.factory!r} returned {type(task).__name__}, expected elastictrain.Task")
    return task


def _check_arg_types(factory: Callable, cfg: TaskConfig) -> None:
    """One line for a task.args value of another type than the factory's annotation says, before the call.

    A wrong type caught here is surely the user's (``task.args.noise=abc`` for ``noise: float``), whereas
    what a factory raises on it can come from deep inside torch and read like a bug. Pydantic's strict
    mode checks it (an int is a float, a bool is no int); the value is passed on as given, never converted.
    Parameters without annotation, or with one pydantic cannot check (a class of the user's), are skipped.
    """
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # an annotation that does not resolve here: the factory's own business
        return
    for name, value in cfg.args.items():
        if name not in hints:
            continue
        try:
            adapter = pydantic.TypeAdapter(hints[name])
        except pydantic.PydanticSchemaGenerationError:
            continue
        try:
            adapter.validate_python(value, strict=True)
        except pydantic.ValidationError:
            expected = getattr(hints[name], "__name__", str(hints[name]).replace("typing.", ""))
            raise ConfigError(
                f"task.args.{name}={_short_repr(redact_secrets({name: value})[name])} is a {type(value).__name__}, "
                f"but {cfg.factory} takes {name}: {expected}; fix task.args.{name}{_yaml_number_hint(value)}"
            ) from None


def _yaml_number_hint(value: Any) -> str:
    """YAML 1.1 reads 1e-3 (no dot) as text: say how to write the number it looks like."""
    try:
        number = float(value) if isinstance(value, str) else None
    except ValueError:
        return ""
    return "" if number is None else f" (YAML reads {value} as text, not a number: write {number!r})"


def _concerns_args(exc: BaseException, args: dict[str, Any]) -> bool:
    """Whether a TypeError/ValueError from the factory is plausibly about the task.args it was given.

    It is when the call itself failed (a missing or unknown keyword: the signature), or when the
    message mentions something the user gave: an argument's name in quotes ('hidden'), a value
    given (its repr, or its text when 2 characters or more, so that a lone digit matches nothing),
    or the type of a value given as Python and torch spell it ('str', type float, not list). An
    int's type does not count: most arguments are ints, and 'int' is in most arithmetic bugs'
    messages. Any other error inside the factory is a bug in it and keeps its traceback.
    """
    if not args:
        return False
    if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
        return True  # raised by the call itself: the arguments do not fit the signature
    message = str(exc)
    for name, value in args.items():
        text, type_name = str(value), type(value).__name__
        if repr(name) in message or repr(value) in message or (len(text) >= 2 and text in message):
            return True
        if type_name != "int" and re.search(rf"'{type_name}'|\b(?:type|not|got) {type_name}\b", message):
            return True
    return False


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
