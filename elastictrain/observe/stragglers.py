"""Stragglers: a rank markedly slower than the others is named in one warning line on rank 0.

Under DDP every step ends in the gradient all-reduce, so every rank's *step time* is the
slowest rank's: a fast rank spends the difference waiting. What tells a straggler apart is the
time a rank spends *outside* that wait, its compute (data, forward, backward, optimizer).
``GradientSyncTimer`` (dist/sync_timer.py) measures the wait: from this rank's last gradient's
arrival to the return of DDP's backward, i.e. waiting for the slowest peer plus the transfer. Compute is the step time minus that wait.

``StragglerReport`` (an observer) compares, once per log interval, each rank's compute with the
median of the other ranks' and names on rank 0 every rank slower by ``factor``, at most once per
interval, and the same rank again only after ``repeat_after_s``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elastictrain.core.events import Observer, RunInfo, TrainInterval

log = logging.getLogger("elastictrain")


@dataclass(frozen=True)
class StragglerSettings:
    factor: float = 2.0  # a rank whose compute per step exceeds the other ranks' median this many times; 0 = off
    min_excess_s: float = 0.005  # and by at least this much: milliseconds of scheduler noise name nobody
    repeat_after_s: float = 300.0  # a rank that stays slow is named again after this long


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float  # mean compute per step over the interval
    others_median_s: float  # the other ranks' median


def compute_s_by_rank(step_time_s_by_rank: Sequence[float], sync_wait_s_by_rank: Sequence[float] | None) -> list[float]:
    """Each rank's compute per step: its step time minus its wait in the gradient all-reduce (step time if unmeasured)."""
    if not sync_wait_s_by_rank:
        return list(step_time_s_by_rank)
    return [max(0.0, s - w) for s, w in zip(step_time_s_by_rank, sync_wait_s_by_rank)]


def others_median_s(compute_s_by_rank: Sequence[float]) -> list[float]:
    """For each rank, the median of the *other* ranks' values (what a rank is judged against); empty below 2 ranks."""
    if len(compute_s_by_rank) < 2:
        return []
    return [
        statistics.median(s for r, s in enumerate(compute_s_by_rank) if r != rank)
        for rank in range(len(compute_s_by_rank))
    ]


def find_stragglers(compute_s_by_rank: Sequence[float], factor: float, min_excess_s: float = 0.0) -> list[Straggler]:
    """Ranks whose compute per step is over ``factor`` times the median of the *other* ranks'.

    The others' median, not everyone's: with two ranks the median of both is their midpoint,
    which a straggler pulls halfway towards itself.
    """
    if factor <= 0 or len(compute_s_by_rank) < 2:
        return []
    found = []
    for rank, (compute_s, others) in enumerate(zip(compute_s_by_rank, others_median_s(compute_s_by_rank))):
        if compute_s > factor * others and compute_s - others >= min_excess_s:
            found.append(Straggler(rank, compute_s, others))
    return found


class StragglerReport(Observer):
    """Rank 0 names slow ranks in one warning line per log interval at most.

    Reads ``TrainInterval.step_time_s_by_rank`` and, where the loop provides it,
    ``sync_wait_s_by_rank`` (each rank's mean wait in the gradient all-reduce); without the
    waits it compares whole step times, which under DDP only shows ranks slowed outside the
    step's collectives.
    """

    def __init__(
        self, settings: StragglerSettings = StragglerSettings(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._is_main = True
        self._last_named: dict[int, float] = {}  # rank -> when it was last named

    def started(self, info: RunInfo) -> None:
        self._is_main = info.rank == 0

    def trained(self, interval: TrainInterval) -> None:
        self.observe(interval.step, interval.step_time_s_by_rank, getattr(interval, "sync_wait_s_by_rank", None))

    def observe(
        self, step: int, step_time_s_by_rank: Sequence[float], sync_wait_s_by_rank: Sequence[float] | None = None
    ) -> None:
        """One interval's per-rank mean step time (and wait in the gradient all-reduce, if measured)."""
        if not self._is_main or not step_time_s_by_rank:
            return
        compute = compute_s_by_rank(step_time_s_by_rank, sync_wait_s_by_rank)
        now = self._clock()
        slow = find_stragglers(compute, self.settings.factor, self.settings.min_excess_s)
        due = [s for s in slow if now - self._last_named.get(s.rank, -float("inf")) >= self.settings.repeat_after_s]
        if not due:
            return
        for straggler in due:
            self._last_named[straggler.rank] = now
        named = ", ".join(
            f"rank {s.rank}: {s.compute_s * 1e3:.1f} ms per step, {s.compute_s / max(s.others_median_s, 1e-9):.1f}x "
            f"the others' median {s.others_median_s * 1e3:.1f} ms"
            for s in due
        )
        measure = (
            "compute = step time minus the wait in the gradient all-reduce" if sync_wait_s_by_rank else "by step time"
        )
        log.warning(
            "straggler at step %d: %s; every rank waits for it in each step (%s; factor %g; named again after "
            "%.0f s if it stays slow)",
            step,
            named,
            measure,
            self.settings.factor,
            self.settings.repeat_after_s,
        )
