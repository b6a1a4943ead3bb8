"""State a custom loop left unregistered, named at RESTORE: an unbroken run never shows it, a resumed one differs.

A snapshot holds what ``session.register`` was given, nothing else. An optimizer or an LR scheduler
left out restarts from scratch on every resume (Adam's moments, the schedule's position), and the
run still exits 0. What is visible at RESTORE is checked here, one warning line each:

- a registered model's trainable parameters that no registered optimizer holds (the optimizer that
  trains them is not registered; or nothing trains them, a hand-made EMA copy say, which wants
  requires_grad_(False); an ``AveragedModel`` is an average by its type);
- a registered optimizer whose parameter groups an LR scheduler has touched (``initial_lr``, set by
  every ``torch.optim.lr_scheduler`` but ReduceLROnPlateau) with no scheduler of it registered.

Deciding is pure (``unregistered_state``); only when it finds something are the live objects
responsible looked for (``live_optimizers_and_schedulers``, one pass over the garbage collector's
objects: 0.15 to 0.45 s for the 260,000 of a process that imported elastictrain, on a busy
2-core machine), to name their classes. Not seen: a scheduler built after restore(), a
ReduceLROnPlateau, any other object holding state.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def unregistered_state(registered: dict[str, Any], live: Iterable[Any] = ()) -> list[str]:
    """One warning line for each piece of state ``registered`` (name -> object) misses; ``live``: optimizers and
    schedulers alive in the process, to name the one responsible (may be empty)."""
    live = [obj for obj in live if not any(obj is value for value in registered.values())]
    optimizers = {name: v for name, v in registered.items() if isinstance(v, torch.optim.Optimizer)}
    held = {id(p) for optimizer in optimizers.values() for group in optimizer.param_groups for p in group["params"]}
    warnings = []
    for name, model in registered.items():
        if not isinstance(model, nn.Module) or isinstance(model, AveragedModel):  # an EMA: averaged, not trained
            continue
        missing = [p for p in model.parameters() if p.requires_grad and id(p) not in held]
        if not missing:
            continue
        ids = {id(p) for p in missing}
        holders = sorted(
            {
                type(o).__name__
                for o in live
                if isinstance(o, torch.optim.Optimizer)
                and any(id(p) in ids for group in o.param_groups for p in group["params"])
            }
        )
        by = f" (an unregistered {' and '.join(holders)} holds them)" if holders else ""
        total = sum(1 for p in model.parameters() if p.requires_grad)
        warnings.append(
            f"model {name!r}: {len(missing)} of its {total} trainable parameters are in no registered optimizer{by}; "
            "session.register() the optimizer that trains them, or a resume restarts its state (Adam's moments) from "
            "zero; a model nothing trains (an EMA, a frozen part) wants requires_grad_(False)"
        )
    for name, optimizer in optimizers.items():
        if any(getattr(v, "optimizer", None) is optimizer for v in registered.values()):
            continue
        if not any("initial_lr" in group for group in optimizer.param_groups):
            continue
        schedulers = sorted(
            {
                type(o).__name__
                for o in live
                if isinstance(o, _SCHEDULERS) and getattr(o, "optimizer", None) is optimizer
            }
        )
        which = (
            f"a {' and a '.join(schedulers)}"
            if schedulers
            else "an LR scheduler (its parameter groups hold initial_lr)"
        )
        warnings.append(
            f"optimizer {name!r} is driven by {which} that is not registered; session.register(lr_scheduler=...) it "
            "before restore(), or a resume restarts the schedule from its first step"
        )
    return warnings


def unregistered_state_named(registered: dict[str, Any]) -> list[str]:
    """``unregistered_state``, naming the live objects responsible when there is anything to say."""
    found = unregistered_state(registered)
    return unregistered_state(registered, live_optimizers_and_schedulers()) if found else found


def live_optimizers_and_schedulers() -> list[Any]:
    """Every optimizer and LR scheduler alive in this process (one pass over the garbage collector's objects)."""
    kinds = (torch.optim.Optimizer, *_SCHEDULERS)
    return [obj for obj in gc.get_objects() if issubclass(type(obj), kinds)]  # type(): no __class__ property runs
