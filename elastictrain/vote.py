"""The per-step vote: requests every rank must agree on travel together in one tiny all_reduce.

A request raised on any rank (a preemption signal reached this worker; rank 0's snapshot timer
fired) must be acted on by every rank at the same step, or the ranks would leave the loop at
different steps and hang in each other's collectives. Each step boundary posts this rank's
requests as a few numbers in ONE all_reduce, started asynchronously so it overlaps the next
step's compute, and reads the result of the previous post; every rank reads the same result at
the same boundary, so they agree. ``settle`` (used whenever the loop leaves TRAIN and after
EVALUATE and SNAPSHOT) waits for anything in flight and exchanges once more synchronously, so no
vote crosses a state boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from typing import Any

import torch

from .dist import DistContext, all_reduce_sum, all_reduce_sum_start


@dataclass(frozen=True)
class Requests:
    """What the ranks asked for, OR-ed over ranks."""

    preempt: bool = False  # a preemption signal reached some rank
    snapshot: bool = False  # rank 0's snapshot.every_seconds timer fired

    def __or__(self, other: "Requests") -> "Requests":
        return Requests(**{f.name: getattr(self, f.name) or getattr(other, f.name) for f in fields(self)})

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([float(getattr(self, f.name)) for f in fields(self)], dtype=torch.float32, device=device)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "Requests":
        flags = values.cpu().tolist()
        return cls(**{f.name: flags[i] > 0 for i, f in enumerate(fields(cls))})


NOTHING = Requests()


class StepVote:
    """Post this rank's requests each step; read the agreed result one step later."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self._pending: tuple[Any, torch.Tensor] | None = None

    def post(self, local: Requests) -> Requests:
        """Start exchanging ``local`` and return the agreed result of the previous post."""
        if not self.ctx.distributed:
            return local
        agreed = self._collect()
        values = local.to_tensor(self.ctx.device)
        self._pending = (all_reduce_sum_start(values, self.ctx), values)
        return agreed

    def settle(self, local: Requests) -> Requests:
        """Finish anything in flight, exchange ``local`` synchronously, return everything agreed."""
        if not self.ctx.distributed:
            return local
        agreed = self._collect()
        return agreed | Requests.from_tensor(all_reduce_sum(local.to_tensor(self.ctx.device), self.ctx))

    def _collect(self) -> Requests:
        if self._pending is None:
            return NOTHING
        work, values = self._pending
        self._pending = None
        work.wait()
        return Requests.from_tensor(values)
