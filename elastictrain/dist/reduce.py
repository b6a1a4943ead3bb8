"""Losses and metrics reduced across ranks, weighted by sample counts so uneven batches are right."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elastictrain.core.errors import LossFnError
from elastictrain.dist.collectives import all_gather, all_reduce_sum
from elastictrain.dist.group import DistContext


class WeightedSums:
    """Sample-weighted sums of the losses and metrics of the steps since the last reduce.

    ``add`` only keeps each step's values (detached, left where they are: no sync, no arithmetic
    per step); ``reduce`` puts them in one float64 tensor, weights them by their sample counts, and
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
        self._floats: list[float] = []  # ``_values`` read so far, as floats (``_read`` reads only the new ones)
        self._agreed = False  # whether every rank's names were found equal to ours

    @property
    def count(self) -> int:
        return sum(self._samples)

    @property
    def steps(self) -> int:
        """Steps added since the last reduce (every rank adds in the same steps, so every rank has the same)."""
        return len(self._samples)

    def add(self, samples: int, values: dict[str, Any]) -> None:
        if self.names is None:
            self.names = sorted(values)
        elif len(values) != len(self.names) or any(name not in values for name in self.names):
            raise LossFnError(
                f"loss_fn returned the metric keys {sorted(values)} after {self.names} in earlier steps; "
                "return the same keys at every step (the snapshots saved so far are kept)"
            )
        # One-element values of any shape ((), (1,), (1, 1)): split_loss has checked that each is a scalar.
        self._values.extend(v.detach() if isinstance(v, torch.Tensor) else v for v in (values[n] for n in self.names))
        self._samples.append(samples)

    # A rank's values since the last reduce are training state: a snapshot between two log steps holds them, so the
    # restored run reduces, at the next log step, exactly what an unbroken one does (no partial record at the
    # snapshot's step). Each value as a float: float32 and float64 both survive a python float exactly.

    def state_dict(self) -> dict[str, Any]:
        """This rank's values since the last reduce; reads only those added since its last call (marks call it at
        every step). Reading a value on an accelerator waits for the device: ``peek`` is the per-step form."""
        return {"names": self.names, "values": list(self._read()), "samples": list(self._samples)}

    def _read(self) -> list[float]:
        """Every value since the last reduce as a python float (exact for any float dtype), each read once."""
        self._floats.extend(float(value) for value in self._values[len(self._floats) :])
        return self._floats

    def peek(self) -> dict[str, Any] | None:
        """``state_dict`` where reading is free (the CPU), else None."""
        return self.state_dict() if self.device.type == "cpu" else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.names = state["names"]
        self._values, self._samples = list(state["values"]), list(state["samples"])
        self._floats = list(state["values"])

    def load_resharded(self, states: list[dict[str, Any]], rank: int) -> None:
        """Another world size: rank 0 takes every saved rank's steps (the reduced means are the same up to the
        order of the sums), the others a step of no samples, so every rank holds steps as every rank reduces."""
        names = next((state["names"] for state in states if state["names"] is not None), None)
        values = [value for state in states for value in state["values"]] if rank == 0 else [0.0] * len(names or [])
        samples = [count for state in states for count in state["samples"]] if rank == 0 else [0]
        self.load_state_dict({"names": names, "values": values, "samples": samples if names is not None else []})

    def discard(self) -> None:
        """Forget the values since the last reduce (a rollback replays their steps)."""
        self._values, self._samples, self._floats = [], [], []

    def reduce(self, ctx: DistContext, flags: Sequence[float] = ()) -> tuple[dict[str, float], list[float]]:
        """Sample-weighted means over all ranks since the last reduce, and the flags summed over ranks."""
        if not self._agreed and self.names is not None:  # the same on every rank: they add in the same steps
            agree_on_names(self.names, ctx)
            self._agreed = True
        names = self.names or []
        if self._samples:
            # Each value in float64 on its own: a python float is not rounded to the default dtype first (a restored
            # value is a python float, and must reduce to what the tensor it was read from does). On the CPU a
            # value is read as a python float (exact), once: a survivor mark may have read it already.
            if self.device.type == "cpu":
                values = torch.tensor(self._read(), dtype=torch.float64)
            else:
                values = torch.stack(
                    [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in self._values]
                )
            per_step = values.reshape(len(self._samples), len(names))
            weights = torch.tensor(self._samples, dtype=torch.float64, device=self.device)
            sums = weights @ per_step
        else:
            sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        extra = torch.tensor([float(self.count), *flags], dtype=torch.float64, device=self.device)
        total = all_reduce_sum(torch.cat([sums, extra]), ctx).tolist()
        count = total[len(names)]
        self.discard()
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
                "rank, or on none (the snapshots saved so far are kept)"
            )


def reduce_means(values: dict[str, float], weight: float, ctx: DistContext) -> dict[str, float]:
    """Means over ranks, each rank's ``values`` (its own means) weighted by its ``weight`` (its sample count).

    One all_gather of python objects (an evaluation's few numbers); ``weighted_means`` does the arithmetic.
    """
    return weighted_means(all_gather((float(weight), {name: float(value) for name, value in values.items()}), ctx))


def weighted_means(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """The mean of each name over ``parts`` of (weight, means), each weighted by its weight.

    The parts' names may differ (a rank that saw no sample of a metric): a name is averaged over the parts that hold
    it. A name whose parts all weigh 0 is left out (empty when every weight is 0).
    """
    names = sorted({name for _, means in parts for name in means})
    totals = {name: sum(w for w, means in parts if name in means) for name in names}
    return {
        name: sum(w * means[name] for w, means in parts if name in means) / totals[name]
        for name in names
        if totals[name]
    }
