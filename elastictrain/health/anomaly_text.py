"""What the self-healing lines say: which ranks and hosts to suspect, the value found, the samples skipped."""

from __future__ import annotations

import math
from collections.abc import Iterable

from elastictrain.core.config import AnomalyConfig

SHOWN_SAMPLES = 8  # sample indices named in a log line (the snapshot's anomaly log keeps them all)


def where(kind: str, ranks: Iterable[int], origin: Iterable[int], hosts: list[str | None], world_size: int) -> str:
    """Where an anomaly was seen, for its line: the ranks (and hosts) to suspect. ``ranks``: those that saw
    something at its step; ``origin``: those whose own loss was non-finite; ``hosts``: each rank's, by rank."""
    ranks, origin = list(ranks), list(origin)

    def named(which: list[int]) -> str:
        return with_hosts(which, [h for r in which if r < len(hosts) and (h := hosts[r]) is not None])

    if world_size == 1:
        return ""
    if kind == "loss":  # a rank's own number: the ranks it was non-finite on, not those its NaN reached through
        return f" on rank(s) {named(origin or ranks)}"  # the all-reduce (their weights, checked before a snapshot)
    if kind != "gradient norm":  # the weights
        return f" on rank(s) {named(ranks)}"
    if len(ranks) == world_size:
        if origin and len(origin) < world_size:
            return (
                f" on every rank after the gradient all-reduce; the loss was non-finite first on rank(s) "
                f"{named(origin)}"
            )
        return " on every rank (after the gradient all-reduce its origin cannot be told)"
    return f" on rank(s) {named(ranks)} only"


def of_ranks(samples: list[int], ranks: tuple[int, ...], world_size: int, rank_batch: int) -> list[int]:
    """The samples of ``ranks`` among a step's global ``samples`` (data/sampling.py's layout: each micro-batch is every
    rank's ``rank_batch`` in rank order); all of them when no rank, or every rank, is named."""
    if not ranks or len(ranks) >= world_size or rank_batch <= 0:
        return list(samples)
    return [index for position, index in enumerate(samples) if (position // rank_batch) % world_size in ranks]


def stated(kind: str, value: float, spike: bool, cfg: AnomalyConfig) -> str:
    return f"{kind} {number(value)}" + (f" (over {cfg.spike_factor:g} x its running mean)" if spike else "")


def number(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def with_hosts(ranks: Iterable[int], hosts: list[str]) -> str:
    ranks = list(ranks)
    names = ", ".join(str(r) for r in ranks)
    unique = sorted(set(hosts))
    return f"{names} (host {', '.join(unique)})" if unique else names


def shown_samples(samples: list[int]) -> str:
    shown = ", ".join(str(i) for i in samples[:SHOWN_SAMPLES])
    return (
        f"global indices {shown}{', ...' if len(samples) > SHOWN_SAMPLES else ''}" if samples else "no sample indices"
    )
