"""The vote: requests every rank must agree on travel together in one tiny all_reduce.

A request raised on any rank (a preemption signal reached this worker; rank 0's snapshot timer
fired) must be acted on by every rank at the same step, or the ranks would leave the loop at
different steps and hang in each other's collectives. A voting step boundary posts this rank's
requests as a few numbers in ONE all_reduce, started asynchronously so it overlaps the next
steps' compute, and reads the result of the previous post; every rank reads the same result at
the same boundary, so they agree. ``settle`` (used whenever the loop leaves TRAIN and after
EVALUATE and SNAPSHOT) waits for anything in flight and exchanges once more synchronously, so no
vote crosses a state boundary.

How often: at most once per step, and no more often than every ``every_s`` seconds. A collective
per step costs a tiny model 45 % on 2 busy CPU cores (its gloo thread competes with the step),
and one every 20 ms still 15-20 %; at one per 0.25 s (the default) or 64 steps the cost is within
noise. A request can wait that long: a signal leaves the job ~30 s to stop. Rank
0 measures the step time between votes and proposes the number of steps to the next vote inside
the vote itself, so every rank reads the same cadence at the same step and they never disagree
on which boundaries vote.

The vote also carries each rank's step (its residue mod 2**20, and that squared): the sums say
whether every rank votes from the same step (they do exactly when W * sum(s**2) == sum(s)**2).
A custom loop that calls ``session.step()`` on some ranks only, or twice, is then one
``UsageError`` at the next vote instead of ranks training on at different data positions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from elastictrain.core.errors import UsageError
from elastictrain.dist.collectives import all_reduce_sum, all_reduce_sum_start
from elastictrain.dist.group import DistContext


@dataclass(frozen=True)
class Requests:
    """What the ranks asked for, OR-ed over ranks."""

    preempt: bool = False  # a preemption signal reached some rank
    snapshot: bool = False  # rank 0's snapshot.durable.every_s timer fired
    snapshot_failed: bool = False  # rank 0's background snapshot write failed for good: every rank stops
    local_snapshot: bool = False  # rank 0's fast-tier timer fired (snapshot.local.every_s)
    anomaly: bool = False  # some rank saw a non-finite or spiking step (anomaly.policy=rollback): every rank rolls back

    def __or__(self, other: Requests) -> Requests:
        if other == NOTHING or other == self:  # the usual case at a step's boundary: nothing asked
            return self
        if self == NOTHING:
            return other
        return Requests(**{f.name: getattr(self, f.name) or getattr(other, f.name) for f in fields(self)})


NOTHING = Requests()
_STEP_RESIDUES = 1 << 20  # int64 sums of squared residues stay exact up to 2**23 ranks
MAX_STEPS_BETWEEN_VOTES = 64  # bounds the delay in steps too, whatever the step time


class StepVote:
    """Post this rank's requests at agreed step boundaries; read the agreed result at the next one.

    ``every_s``: the least time between two votes (0: every step). The vote's tensor carries the
    request flags, OR-ed as a sum, and one more number only rank 0 fills: the steps until the
    next vote.
    """

    def __init__(self, ctx: DistContext, every_s: float = 0.0) -> None:
        self.ctx = ctx
        self.every_s = every_s
        self.steps_between = 1  # agreed: every rank applies the same value at the same boundary
        self._countdown = 0
        self._window: tuple[float, int] | None = None  # rank 0: (time, steps) since the last post
        self._pending: tuple[Any, torch.Tensor] | None = None

    def post(self, local: Callable[[], Requests], step: int = 0) -> Requests:
        """At a voting boundary, start exchanging ``local()`` and return the agreed result of the previous post."""
        if not self.ctx.distributed:
            return local()
        self._countdown -= 1
        if self._countdown > 0:
            if self._window is not None:
                self._window = (self._window[0], self._window[1] + 1)
            return NOTHING
        agreed = self._collect()
        values = self._tensor(local(), self._proposal(), step)
        self._pending = (all_reduce_sum_start(values, self.ctx), values)
        self._countdown = self.steps_between
        return agreed

    def settle(self, local: Requests, step: int = 0) -> Requests:
        """Finish anything in flight, exchange ``local`` synchronously, return everything agreed."""
        if not self.ctx.distributed:
            return local
        agreed = self._collect()
        settled = self._read(all_reduce_sum(self._tensor(local, 0, step), self.ctx))
        self._countdown, self._window = 0, None  # the next boundary votes; time outside TRAIN is no step time
        return agreed | settled

    def _proposal(self) -> int:
        """Rank 0: steps until the vote after this one, from the mean step time since the last vote."""
        if not self.ctx.is_main:
            return 0
        now, window = time.perf_counter(), self._window
        self._window = (now, 1)
        if self.every_s <= 0 or window is None:
            return 1
        step_s = (now - window[0]) / window[1]
        return max(
            1,
            min(MAX_STEPS_BETWEEN_VOTES, math.floor(self.every_s / step_s) if step_s > 0 else MAX_STEPS_BETWEEN_VOTES),
        )

    def _tensor(self, local: Requests, proposal: int, step: int) -> torch.Tensor:
        flags = [int(getattr(local, f.name)) for f in fields(Requests)]
        residue = step % _STEP_RESIDUES
        return torch.tensor([*flags, proposal, residue, residue * residue], dtype=torch.int64, device=self.ctx.device)

    def _read(self, values: torch.Tensor) -> Requests:
        numbers = values.cpu().tolist()
        total, squares = numbers[-2], numbers[-1]
        if self.ctx.world_size * squares != total * total:
            raise UsageError(
                f"the ranks voted from different steps (mean {total / self.ctx.world_size:g}): session.step() must be "
                "called on every rank, once per optimizer step, in the same order as every other rank's"
            )
        numbers = numbers[:-2]
        if numbers[-1] >= 1:  # 0 from settle: keep the cadence
            self.steps_between = int(numbers[-1])
        return Requests(**{f.name: numbers[i] > 0 for i, f in enumerate(fields(Requests))})

    def _collect(self) -> Requests:
        if self._pending is None:
            return NOTHING
        work, values = self._pending
        self._pending = None
        work.wait()
        return self._read(values)
