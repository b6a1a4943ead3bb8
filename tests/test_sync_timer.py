"""The straggler report's input: how long a rank waits in DDP's gradient all-reduce, one hook a step.

A one-rank gloo group in this process (a HashStore: no server) wraps a small MLP in DDP. The timer learns
which parameter's gradient arrives last at the first step of each log interval, keeps only that hook until
the next ``take()``, and measures the wait from that gradient to the backward's end.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from elastictrain.dist.sync_timer import GradientSyncTimer


class CountingTimer(GradientSyncTimer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.seen: list[torch.Tensor] = []

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self.calls += 1
        self.seen.append(parameter)
        super()._gradient_ready(parameter)


@pytest.fixture
def ddp_model():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        yield nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    finally:
        tdist.destroy_process_group()


def _step(model: nn.Module, timer: GradientSyncTimer, wait_s: float = 0.0) -> int:
    """One synchronising backward; ``wait_s``: time between the backward's end and ``backward_done`` (counted as
    waiting, as the all-reduce's return would be). Returns the hook calls it made."""
    before = getattr(timer, "calls", 0)
    model(torch.randn(3, 4)).sum().backward()
    time.sleep(wait_s)
    timer.backward_done()
    for p in model.parameters():
        p.grad = None
    return getattr(timer, "calls", 0) - before


def test_after_the_first_step_one_hook_remains_the_last_gradient_s_and_each_take_learns_again(ddp_model):
    timer = CountingTimer()
    timer.register(ddp_model)
    parameters = list(ddp_model.module.parameters())
    assert _step(ddp_model, timer) == len(parameters)  # learning: every parameter
    last = timer.seen[-1]
    assert any(last is p for p in parameters[:2])  # the first layer's gradients arrive last in the backward
    assert [_step(ddp_model, timer) for _ in range(3)] == [1, 1, 1]
    assert all(seen is last for seen in timer.seen[-3:])
    timer.take()
    assert _step(ddp_model, timer) == len(parameters)  # a new interval learns the order again
    assert _step(ddp_model, timer) == 1


def test_the_wait_is_measured_from_the_last_gradient_with_one_hook_as_with_all(ddp_model):
    timer = GradientSyncTimer()
    timer.register(ddp_model)
    _step(ddp_model, timer, wait_s=0.05)  # learning, every hook
    _step(ddp_model, timer, wait_s=0.05)  # one hook
    waited = timer.take()
    assert 0.05 <= waited < 0.5  # per step: the sleep after the last gradient (not the whole backward, not zero)


def test_a_model_not_wrapped_in_ddp_has_no_hooks():
    timer = CountingTimer()
    model = nn.Linear(2, 2)
    timer.register(model)
    model(torch.randn(1, 2)).sum().backward()
    timer.backward_done()
    assert timer.calls == 0 and timer.take() == 0.0
