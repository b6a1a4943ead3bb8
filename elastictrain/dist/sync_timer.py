"""How long this rank waits for the others in the gradient all-reduce: the straggler report's input (observe/stragglers.py)."""

from __future__ import annotations

import time

import torch
from torch.utils.hooks import RemovableHandle


class GradientSyncTimer:
    """How long this rank waits in the gradient all-reduce each step, with DDP's reduction left alone.

    A hook notes when a parameter's gradient has been accumulated; the last of those ends this
    rank's backward compute. DDP's ``backward()`` returns only once the last bucket's all-reduce
    has come back, so the wait is backward's return minus the last gradient's arrival: the time
    this rank spent waiting for the others. (A Python communication hook that timed the all-reduce
    itself cost 10 % of the step at 4xLinear(1024): it scaled every bucket in a pass of its own and
    called back into Python from gloo's thread.)

    Which gradient arrives last is learnt, not assumed: at the first step of each log interval
    every parameter has a hook; from the next step on only the parameter found last keeps one, so
    a step pays one small Python call, not one per parameter (~1 µs each: 0.4 ms a backward at 300
    tensors, benchmarks/hook_cost.py). An order that changes within an interval (a dynamic graph)
    at worst counts some of the backward after the hooked gradient as waiting, until the next
    interval learns again.

    ``register(ddp_model)`` before the first step, ``backward_done()`` after the backward that
    synchronises (the last micro-batch), ``take()`` for the mean wait per step since the last take.
    """

    def __init__(self) -> None:
        self._waited_s = 0.0
        self._steps = 0
        self._last_ready: float | None = None
        self._last_parameter: torch.Tensor | None = None  # whose gradient arrived last, while learning
        self._parameters: list[torch.Tensor] = []
        self._hooks: list[RemovableHandle] = []
        self._learning = False  # every parameter hooked: this step finds the last one

    def register(self, model: torch.nn.Module) -> None:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        self._parameters = [p for p in model.module.parameters() if p.requires_grad]
        self._learn()

    def _learn(self) -> None:
        """Hook every parameter: the next synchronising backward finds whose gradient arrives last."""
        self._hook(self._parameters)
        self._learning = True

    def _hook(self, parameters: list[torch.Tensor]) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in parameters]

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self._last_ready = time.perf_counter()
        if self._learning:
            self._last_parameter = parameter

    def backward_done(self) -> None:
        if self._last_ready is None:
            return
        self._waited_s += time.perf_counter() - self._last_ready
        self._steps += 1
        self._last_ready = None
        if self._learning and self._last_parameter is not None:
            self._hook([self._last_parameter])  # until the next take(): one hook a step
            self._learning, self._last_parameter = False, None

    def waited(self, seconds: float) -> None:
        """One step's wait measured by the caller (the virtual shards' all_gather)."""
        self._waited_s += seconds
        self._steps += 1

    def take(self) -> float:
        """Mean seconds per step this rank waited for the gradient all-reduce since the last take."""
        waited, steps = self._waited_s, self._steps
        self._waited_s, self._steps = 0.0, 0
        if self._parameters and not self._learning:
            self._learn()  # the order may have changed: the interval's first step learns it again
        return waited / steps if steps else 0.0
