"""How long this rank waits for the others in the gradient all-reduce: the straggler report's input (observe/stragglers.py)."""

from __future__ import annotations

import time

import torch


class GradientSyncTimer:
    """How long this rank waits in the gradient all-reduce each step, with DDP's reduction left alone.

    A hook on every parameter notes when its gradient has been accumulated; the last of those ends
    this rank's backward compute. DDP's ``backward()`` returns only once the last bucket's
    all-reduce has come back, so the wait is backward's return minus the last gradient's arrival:
    the time this rank spent waiting for the others. (A Python communication hook that timed the
    all-reduce itself cost 10 % of the step at 4xLinear(1024): it scaled every bucket in a pass of
    its own and called back into Python from gloo's thread; these hooks cost one small Python call
    per parameter.)

    ``register(ddp_model)`` before the first step, ``backward_done()`` after the backward that
    synchronises (the last micro-batch), ``take()`` for the mean wait per step since the last take.
    """

    def __init__(self) -> None:
        self._waited_s = 0.0
        self._steps = 0
        self._last_ready: float | None = None

    def register(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        for parameter in model.module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self._last_ready = time.perf_counter()

    def backward_done(self) -> None:
        if self._last_ready is None:
            return
        self._waited_s += time.perf_counter() - self._last_ready
        self._steps += 1
        self._last_ready = None

    def waited(self, seconds: float) -> None:
        """One step's wait measured by the caller (the virtual shards' all_gather)."""
        self._waited_s += seconds
        self._steps += 1

    def take(self) -> float:
        """Mean seconds per step this rank waited for the gradient all-reduce since the last take."""
        waited, steps = self._waited_s, self._steps
        self._waited_s, self._steps = 0.0, 0
        return waited / steps if steps else 0.0
