"""Losses and metrics reduced across ranks, weighted by sample counts so uneven batches are right."""

from __future__ import annotations

from typing import Any

import torch

from .collectives import all_gather, all_reduce_sum
from .dist import DistContext
from .errors import LossFnError


class WeightedSums:
    """Sample-weighted sums of the losses and metrics of the steps since the last reduce.

    ``add`` only keeps each step's values (detached, left where they are: no sync, no arithmetic
    per step); ``reduce`` stacks them once, weights them by their sample counts in float64, and
    sends the sums, the sample count and any extra numbers in ONE all_reduce, so whatever rides
    along (each rank's step time) costs no extra collective. Every rank must add the same metric
    names in every step: a rank's names are fixed by its first step (``add`` checks each step's
    against them), and the ranks agree on them once, in the first ``reduce`` that has any
    (one small all_gather per attempt), so a key returned on some ranks only is one LossFnError
    naming the rank and the key on every rank, not a collective of mismatched sizes.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: list[str] | None = None
        self._values: list[Any] = []  # len(names) values per step, step after step
        self._samples: list[int] = []
        self._folded: tuple[int, list[float]] = (0, [])  # ``pending``'s sums so far: (steps folded, sums)
        self._agreed = False  # whether every rank's names were found equal to ours

    @property
    def count(self) -> int:
        return sum(self._samples)

    def add(self, samples: int, values: dict[str, Any]) -> None:
        if self.names is None:
            self.names = sorted(values)
        elif len(values) != len(self.names) or any(name not in values for name in self.names):
            raise LossFnError(f"loss_fn returned the metric keys {sorted(values)} after {self.names} in earlier steps; "
                              "return the same keys at every step (the snapshots saved so far are kept)")
        # One-element values of any shape ((), (1,), (1, 1)): split_loss has checked that each is a scalar.
        self._values.extend(v.detach() if isinstance(v, torch.Tensor) else v for v in (values[n] for n in self.names))
        self._samples.append(samples)

    def pending(self) -> tuple[list[str], list[float], int] | None:
        """This rank's float64 sums since the last reduce, and their sample count; None off the CPU.

        Called at every step (survivor copies), so it folds in only the steps added since its last
        call. On an accelerator, reading a value would make the host wait for the device at every step.
        """
        if self.device.type != "cpu":
            return None
        names = self.names or []
        folded, sums = self._folded
        sums = sums or [0.0] * len(names)
        for step in range(folded, len(self._samples)):
            weight = self._samples[step]
            row = self._values[step * len(names):(step + 1) * len(names)]
            sums = [total + weight * float(value) for total, value in zip(sums, row)]
        self._folded = (len(self._samples), sums)
        return names, list(sums), self.count

    def discard(self) -> None:
        """Forget the values since the last reduce (a rollback replays their steps)."""
        self._values, self._samples, self._folded = [], [], (0, [])

    def reduce(self, ctx: DistContext, flags: list[float] = ()) -> tuple[dict[str, float], list[float]]:
        """Sample-weighted means over all ranks since the last reduce, and the flags summed over ranks."""
        if not self._agreed and self.names is not None:  # the same on every rank: they add in the same steps
            agree_on_names(self.names, ctx)
            self._agreed = True
        names = self.names or []
        if self._samples:
            values = torch.stack([torch.as_tensor(v, device=self.device).reshape(()) for v in self._values])
            per_step = values.to(torch.float64).reshape(len(self._samples), len(names))
            weights = torch.tensor(self._samples, dtype=torch.float64, device=self.device)
            sums = weights @ per_step
        else:
            sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        extra = torch.tensor([float(self.count), *flags], dtype=torch.float64, device=self.device)
        total = all_reduce_sum(torch.cat([sums, extra]), ctx).tolist()
        count = total[len(names)]
        self._values, self._samples, self._folded = [], [], (0, [])
        means = {name: total[i] / count for i, name in enumerate(names)} if count else {}
        return means, total[len(names) + 1 :]


def agree_on_names(names: list[str], ctx: DistContext) -> None:
    """Raise the same LossFnError on every rank unless every rank's loss_fn returned these metric names."""
    by_rank = [set(theirs) for theirs in all_gather(names, ctx)]
    for key in sorted(set().union(*by_rank)):
        holders = [rank for rank, theirs in enumerate(by_rank) if key in theirs]
        if len(holders) < len(by_rank):
            lacking = next(rank for rank, theirs in enumerate(by_rank) if key not in theirs)
            raise LossFnError(
                f"rank {holders[0]}'s loss_fn returned the metric key {key!r} and rank {lacking}'s did not ({len(holders)} "
                f"of {len(by_rank)} ranks returned it); every rank must return the same metric keys: return it on every "
                "rank, or on none (the snapshots saved so far are kept)")


def reduce_objects(count: int, sums: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Sample-weighted means of python sums over ranks whose metric names may differ (evaluation)."""
    parts = all_gather((count, sums), ctx)
    total = sum(c for c, _ in parts)
    names = sorted({name for _, s in parts for name in s})
    return {name: sum(s.get(name, 0.0) for _, s in parts) / total for name in names} if total else {}
