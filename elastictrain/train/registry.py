"""Everything the user registered as state, by name: what every snapshot holds besides the run's own.

Models (unwrapped from DDP and torch.compile) are the snapshot's weights: one registered model is
the model, several are saved as one ``nn.ModuleDict`` of them. Optimizers get a step hook, so that a
survivor copy can tell a step half done (session.py). A scheduler factory (``PendingScheduler``) is
built once the run's length is known.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elastictrain.core.errors import UsageError
from elastictrain.dist import ddp, fsdp
from elastictrain.train.runstate import RESERVED_NAMES
from elastictrain.train.task import PendingScheduler


class Registry:
    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.wrapped: list[nn.Module] = []  # what session.wrap() wrapped: each must be registered
        self.optimizer_steps = 0  # registered optimizers' steps since the session last reset it
        self.replaced: dict[int, nn.Parameter] = {}  # id(parameter) -> the sharded one FSDP put in its place (fsdp.py)

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1

    def add(self, name: str, value: Any) -> None:
        if name in RESERVED_NAMES or name in self.objects:
            taken = "elastictrain's own state" if name in RESERVED_NAMES else "registered already"
            raise UsageError(f"session.register({name}=...): the name {name!r} is {taken}; choose another name")
        if value is not None and not (
            callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
        ):
            raise UsageError(
                f"session.register({name}=...): a {type(value).__name__} has no state_dict() and "
                "load_state_dict(); register objects that do (models, optimizers, schedulers, ...)"
            )
        if isinstance(value, torch.optim.Optimizer):
            fsdp.rebind(value, self.replaced)
            value.register_step_post_hook(self._optimizer_stepped)
        self.objects[name] = ddp.state_module(value) if isinstance(value, nn.Module) else value

    def model(self) -> nn.Module:
        """The weights of every snapshot: the one registered model, or a ModuleDict of several."""
        modules = {name: m for name, m in self.objects.items() if isinstance(m, nn.Module)}
        if not modules:
            raise UsageError(
                "session.restore() with no model registered: session.register(model=model) first, "
                "or the snapshots would hold no weights"
            )
        for wrapped in self.wrapped:
            if not any(wrapped is m for m in modules.values()):
                raise UsageError(
                    f"a {type(wrapped).__name__} wrapped by session.wrap() is not registered: "
                    "session.register(name=model), or its weights would not be in the snapshots"
                )
        return next(iter(modules.values())) if len(modules) == 1 else nn.ModuleDict(modules)

    def statefuls(self) -> dict[str, Any]:
        """Everything but the models (name -> object, or None for an optional one such as a missing scheduler)."""
        return {name: v for name, v in self.objects.items() if not isinstance(v, nn.Module)}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [v for v in self.objects.values() if isinstance(v, torch.optim.Optimizer)]

    def with_schedulers(self) -> list[tuple[torch.optim.Optimizer, Any]]:
        """Each optimizer and the scheduler that drives it (None if none is registered)."""

        def scheduler_of(optimizer: Any) -> Any:
            return next((v for v in self.objects.values() if getattr(v, "optimizer", None) is optimizer), None)

        return [(o, scheduler_of(o)) for o in self.optimizers()]

    def build_schedulers(self, total_steps: int, statefuls: dict[str, Any]) -> None:
        """Each scheduler factory, now that the run's length is known; ``statefuls`` (the snapshots') gets it too."""
        for name, value in list(self.objects.items()):
            if isinstance(value, PendingScheduler):
                self.objects[name] = statefuls[name] = value.build(total_steps)
