"""Losses and metrics reduced across ranks, weighted by sample counts so uneven batches are right."""

from __future__ import annotations

from typing import Any

import torch

from .dist import DistContext, all_gather, all_reduce_sum


class WeightedSums:
    """Running sums of ``value * samples`` per metric, kept on the device (no sync per step).

    ``reduce`` sends them, the sample count and any extra flags in ONE all_reduce, so the
    decisions that ride along (e.g. "rank 0's snapshot timer fired") cost no extra collective.
    Every rank must add the same metric names in the same steps, as training guarantees.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: list[str] | None = None
        self.sums: torch.Tensor | None = None
        self.count = 0

    def add(self, samples: int, values: dict[str, Any]) -> None:
        if self.names is None:
            self.names = sorted(values)
        if self.sums is None:
            self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        # One-element values of any shape ((), (1,), (1, 1)): split_loss has checked that each is a scalar.
        vector = torch.stack([
            torch.as_tensor(values[name], device=self.device).detach().double().reshape(()) for name in self.names
        ])
        self.sums += vector * samples
        self.count += samples

    def reduce(self, ctx: DistContext, flags: list[float] = ()) -> tuple[dict[str, float], list[float]]:
        """Sample-weighted means over all ranks since the last reduce, and the flags summed over ranks."""
        names = self.names or []
        sums = self.sums if self.sums is not None else torch.zeros(len(names), dtype=torch.float64, device=self.device)
        extra = torch.tensor([float(self.count), *flags], dtype=torch.float64, device=self.device)
        total = all_reduce_sum(torch.cat([sums, extra]), ctx).tolist()
        count = total[len(names)]
        self.sums, self.count = None, 0
        means = {name: total[i] / count for i, name in enumerate(names)} if count else {}
        return means, total[len(names) + 1 :]


def reduce_objects(count: int, sums: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Sample-weighted means of python sums over ranks whose metric names may differ (evaluation)."""
    parts = all_gather((count, sums), ctx)
    total = sum(c for c, _ in parts)
    names = sorted({name for _, s in parts for name in s})
    return {name: sum(s.get(name, 0.0) for _, s in parts) / total for name in names} if total else {}
