"""When the fast tier's next timed snapshot is due: a fixed interval, or Young/Daly's from what was measured.

A snapshot every T seconds that costs C seconds of training, in a job that fails on average
every M seconds, loses about C / T to snapshots and T / (2 M) to work redone after a failure.
The sum is least at T = sqrt(2 C M) (Young 1974; Daly 2006 refines it for C close to M), where
each part is sqrt(C / (2 M)). ``snapshot.local.every_s: auto`` takes both from the run:

- C: the median cost of this node's last fast snapshots, training's wait plus the background
  write (the write's whole wall time: on busy cores it takes that much from training, on idle
  ones less, so T errs long, where the loss curve is flattest);
- M: the run's training time over its failures so far (``failures_and_exposure``; a failure a
  survivor copy covered does not count), with a prior ``snapshot.local.mtbf_prior_s`` (P, 1 h by
  default) counted as one more failure after P more seconds: M = (t + P) / (failures + 1). At the
  start of a run M is P, not the second or so trained so far, which would ask for a copy every
  few tenths of a second; each failure then moves M toward what the run measures. P = 0: no
  prior, M = t / max(failures, 1), so T grows as sqrt(2 C t) while nothing fails.

Rank 0 owns the timer (the vote makes every rank act on it at the same step). It imports nothing
of the loop: it is an observer the loop asks once per vote.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from elastictrain.core.events import Observer, SnapshotReport, Tier
from elastictrain.core.states import State

log = logging.getLogger("elastictrain")

AUTO = "auto"
FIRST_INTERVAL_S = 1.0  # auto, before any cost is measured: the first fast copy comes early and is measured
MIN_INTERVAL_S = 0.1  # auto never asks more often (one vote apart is the least the loop can act on anyway)
COSTS_KEPT = 9  # the median of this many recent snapshots: one slow write does not move the interval
COST_KEY = "fast_copy_s"  # an attempt's record (RunLog): the median cost its fast copies measured so far


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """The snapshot interval that loses the least to snapshots and redone work together: sqrt(2 C M)."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


def failures_and_exposure(attempts: list[dict[str, Any]], current_s: float) -> tuple[int, float]:
    """The run's failures and training seconds from its attempt records (``RunLog.attempts``).

    An attempt that ended without a preemption snapshot failed (the next one is its restart or
    relaunch), unless a survivor copy of its last step was written (``survivor.py``): that failure
    lost no work a timed copy could have saved. The one running now has not failed. Exposure: each earlier attempt's time up to its last
    snapshot, plus ``current_s`` of this one. An attempt that died before its first snapshot left
    no record; its failure is the one counted for the attempt before it.
    """
    earlier = attempts[:-1]
    failures = sum(1 for attempt in earlier if not attempt.get("preempted") and not attempt.get("survivor_copy"))
    return failures, sum(float(attempt.get("wall_s", 0.0)) for attempt in earlier) + max(current_s, 0.0)


class FastTierTimer(Observer):
    """Rank 0's clock for timed fast-tier snapshots: ``every_s`` seconds apart, or Young/Daly's (``"auto"``)."""

    def __init__(
        self, every_s: float | str, clock: Callable[[], float] = time.monotonic, prior_mtbf_s: float = 0.0
    ) -> None:
        self.auto = every_s == AUTO
        self.prior_mtbf_s = prior_mtbf_s
        self.every_s = 0.0 if self.auto else float(every_s)
        self.clock = clock
        self.failures = 0
        self._exposure_before_s = 0.0
        self._attempt_started = clock()
        self._last = self._attempt_started
        self._costs: deque[float] = deque(maxlen=COSTS_KEPT)
        self._announced = False  # the attempt's first measured copy logs the interval

    @property
    def enabled(self) -> bool:
        return self.auto or self.every_s > 0

    def begin(self, attempts: list[dict[str, Any]]) -> None:
        """At the end of RESTORE: the run's failures and training time before this attempt, and the copy cost
        the attempt before measured (``COST_KEY`` of its record), which this attempt's own costs soon outvote:
        a restarted attempt's first copy comes one Young/Daly interval in, not ``FIRST_INTERVAL_S``."""
        self.failures, self._exposure_before_s = failures_and_exposure(attempts, 0.0)
        self._attempt_started = self._last = self.clock()
        self._costs.clear()  # measured again on this attempt's ranks and cores
        self._announced = False
        earlier = attempts[-2].get(COST_KEY) if len(attempts) > 1 else None
        if self.auto and earlier:
            self._costs.append(float(earlier))
            self._announce("the attempt before measured")

    def exposure_s(self) -> float:
        return self._exposure_before_s + self.clock() - self._attempt_started

    def mtbf_s(self) -> float:
        """Training time per failure so far, the prior counted as one failure after its seconds."""
        prior_failures = 1 if self.prior_mtbf_s > 0 else 0
        return (self.exposure_s() + self.prior_mtbf_s) / max(self.failures + prior_failures, 1)

    def cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def interval_s(self) -> float:
        if not self.auto:
            return self.every_s
        cost = self.cost_s()
        if cost is None:
            return FIRST_INTERVAL_S
        return max(MIN_INTERVAL_S, young_daly_interval_s(cost, self.mtbf_s()))

    def due(self) -> bool:
        return self.enabled and self.clock() - self._last >= self.interval_s()

    # -- observer events: a fast copy is taken at LOCAL_SNAPSHOT and beside every durable one -----

    def transition(self, src: State, dst: State, step: int) -> None:
        if dst in (State.LOCAL_SNAPSHOT, State.SNAPSHOT):
            self._last = self.clock()

    def snapshotted(self, report: SnapshotReport) -> None:
        if report.tier is Tier.LOCAL and report.committed:
            first = self.auto and not self._announced
            self._costs.append(report.duration_s + report.write_s)
            if first:
                self._announce("measured")

    def _announce(self, cost_from: str) -> None:
        self._announced = True
        log.info(
            "fast-tier copies every %.2f s from now on (auto, Young/Daly: %.0f ms a copy, %d failure(s) in %.0f s "
            "of training; the cost %s)",
            self.interval_s(),
            statistics.median(self._costs) * 1e3,
            self.failures,
            self.exposure_s(),
            cost_from,
        )
