"""Goodput: where the job's wall-clock seconds went, by cause, carried across restarts in the snapshot.

Like Google's ml-goodput-measurement, time is split into productive training and the kinds of
badput a fault-tolerant job pays for: blocking snapshots, restores, re-training steps an earlier
attempt had already reached (recompute), evaluation, and restarting (rendezvous and process
start of a restarted attempt). ``goodput_ratio`` is productive seconds over all seconds counted.

Every rank keeps its own ``Goodput`` (the events are the same on every rank); rank 0's is the
one exported. The counters travel in the snapshot (``state_dict``), so they are monotonic over
the whole run: a restored attempt continues from the saved totals. Seconds an attempt spent
after its last snapshot are lost from the counters when it is killed; the steps it reached are
not, because rank 0 records its highest step in the launcher's store (``RunInfo.store``) at most
every ``HIGH_WATER_EVERY_S`` (the loop calls ``stepped`` after each optimizer step), at each
log interval and as its attempt ends (a peer lost: rank 0 survives it and writes the step it
reached), and the next attempt counts re-training up to that step as ``recompute``. Only the
steps of a rank 0 killed itself, after its last write, go uncounted.

The first attempt's own start-up (process start to the first state) is not counted anywhere:
it is the cost of launching a job at all, not of a fault.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from elastictrain.core.events import Observer, RunInfo
from elastictrain.core.states import TERMINAL, State

log = logging.getLogger("elastictrain")

CAUSES = ("productive", "snapshot", "restore", "recompute", "evaluate", "restart", "rollback")
HIGH_WATER_KEY = "high_water_step"  # in RunInfo.store: the highest global step any attempt trained to
# Rank 0 writes its step to the store at most this often: one small set() a second, and a killed
# attempt's last steps before it (at most this long of training) are counted as productive.
HIGH_WATER_EVERY_S = 1.0

# Seconds spent in a state go to one cause; TRAIN is split between productive and recompute by step.
_CAUSE_OF_STATE = {
    State.SNAPSHOT: "snapshot",
    State.LOCAL_SNAPSHOT: "snapshot",
    State.RESTORE: "restore",
    State.EVALUATE: "evaluate",
    State.ROLLBACK: "rollback",
}

# A Trainer run twice in one process (a notebook, an in-process test) must not count the
# process's whole age as the second run's restart time: it counts from the first one's end.
_last_closed_unix: float = 0.0


class Goodput(Observer):
    """Seconds by cause (``seconds_by_cause()``) and ``goodput_ratio()``; save it in the snapshot as ``goodput``.

    Wire it on every rank: add it to the observers and put it in the snapshot under ``goodput``;
    ``load_state_dict`` must run before the ``restored`` event.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, process_age_s: Callable[[], float] | None = None
    ) -> None:
        self._clock = clock
        self._process_age_s = process_age_s or process_age_s_now
        self._lock = threading.Lock()  # the metrics server reads from its own thread
        self._restored_seconds = dict.fromkeys(CAUSES, 0.0)  # totals of earlier attempts, from the snapshot
        self._attempt_seconds = dict.fromkeys(CAUSES, 0.0)  # this attempt's closed intervals
        self._info: RunInfo | None = None
        self._state = State.SETUP
        self._since = clock()  # when the open interval (in self._state) began
        self._step = 0  # global step at self._since
        self._high_water_step = 0  # steps up to here were already trained by an earlier attempt
        self._high_water_written = 0  # rank 0: the highest step it has put in the store
        self._store_gone = False  # rank 0: a write failed (the agent hosting the store exited)
        self._high_water_written_at = clock()
        self._pending_restart_s: float | None = None  # process start -> first transition, until we know it counts
        self._restart_counted = False

    # -- events -----------------------------------------------------------------------------

    def started(self, info: RunInfo) -> None:
        self._info = info
        if info.store is not None and info.store.check([HIGH_WATER_KEY]):
            # Read once per attempt: later writes are this attempt's own progress, not recompute.
            self._high_water_step = int(info.store.get(HIGH_WATER_KEY))
            self._high_water_written = self._high_water_step  # what the store holds: written again only above it

    def transition(self, src: State, dst: State, step: int) -> None:
        now = self._clock()
        with self._lock:
            if self._pending_restart_s is None and not self._restart_counted:
                self._pending_restart_s = self._process_age_s()
                if self._info is not None and self._info.restart_count > 0:
                    self._count_restart()
            self._close_interval(now, step)
            self._state = dst

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        if from_snapshot:  # after load_state_dict: added on top of the restored totals
            with self._lock:
                self._count_restart()

    def rolled_back(self, from_step: int, to_step: int, duration_s: float) -> None:
        """The replay of a rollback (anomalies.py) re-trains steps this attempt had reached: recompute."""
        with self._lock:
            self._high_water_step = max(self._high_water_step, from_step)

    def stepped(self, step: int) -> None:
        """An optimizer step is done (called by the loop at every step: a clock read, a store write a second)."""
        if self._clock() - self._high_water_written_at >= HIGH_WATER_EVERY_S:
            self._write_high_water(step)

    def trained(self, interval: Any) -> None:
        with self._lock:
            self._close_interval(self._clock(), interval.step)
        self._write_high_water(interval.step)

    def closed(self) -> None:
        global _last_closed_unix
        with self._lock:
            if self._state not in TERMINAL:
                self._close_interval(self._clock(), self._step)
                self._state = State.FAILED
        _last_closed_unix = time.time()
        self._write_high_water(self._step)  # the step this attempt reached, for the next one's recompute

    # -- results ----------------------------------------------------------------------------

    def seconds_by_cause(self) -> dict[str, float]:
        """Seconds counted so far for each cause in ``CAUSES``, this attempt and every restored one."""
        with self._lock:
            return {cause: self._restored_seconds[cause] + self._attempt_seconds[cause] for cause in CAUSES}

    def goodput_ratio(self) -> float:
        """Productive seconds over all seconds counted (1.0 before anything is counted)."""
        seconds = self.seconds_by_cause()
        total = sum(seconds.values())
        return seconds["productive"] / total if total > 0 else 1.0

    # -- Stateful ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The totals, including the open interval up to now (the snapshot being written counts)."""
        now = self._clock()
        with self._lock:
            seconds = {cause: self._restored_seconds[cause] + self._attempt_seconds[cause] for cause in CAUSES}
            cause = _CAUSE_OF_STATE.get(self._state)
            if cause is not None:
                seconds[cause] += now - self._since
        return {"seconds_by_cause": seconds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["seconds_by_cause"]
        with self._lock:
            self._restored_seconds = {cause: float(saved[cause]) for cause in CAUSES}

    # -- internals --------------------------------------------------------------------------

    def _write_high_water(self, step: int) -> None:
        info = self._info
        if info is None or info.rank != 0 or info.store is None or self._store_gone:  # only rank 0 writes the store
            return
        self._high_water_written_at = self._clock()
        step = max(step, self._high_water_step)  # a rollback's replay starts below the step it rolled back from
        if step > self._high_water_written:
            try:
                info.store.set(HIGH_WATER_KEY, str(step))
            except Exception as error:  # the launcher's store gone with its agent: the next attempt counts less
                log.debug("goodput: the high-water step is no longer written: %s", error)
                self._store_gone = True  # not tried again: each failed set() costs torch a warning with a stack
                return
            self._high_water_written = step

    def _close_interval(self, now: float, step: int) -> None:
        """Add the time since the last mark to its cause; TRAIN time splits by the steps it covered."""
        elapsed = now - self._since
        if self._state is State.TRAIN:
            self._attempt_seconds["recompute"] += elapsed * self._recompute_fraction(self._step, step)
            self._attempt_seconds["productive"] += elapsed * (1.0 - self._recompute_fraction(self._step, step))
        elif self._state in _CAUSE_OF_STATE:
            self._attempt_seconds[_CAUSE_OF_STATE[self._state]] += elapsed
        self._since, self._step = now, step

    def _recompute_fraction(self, first_step: int, last_step: int) -> float:
        """Of the steps (first_step, last_step], the share an earlier attempt had already trained."""
        if last_step <= first_step:  # time in TRAIN with no step finished: judged by where it stands
            return 1.0 if last_step < self._high_water_step else 0.0
        redone = min(last_step, self._high_water_step) - first_step
        return min(max(redone / (last_step - first_step), 0.0), 1.0)

    def _count_restart(self) -> None:
        if self._pending_restart_s is not None and not self._restart_counted:
            self._attempt_seconds["restart"] += self._pending_restart_s
            self._restart_counted = True


def process_age_s_now() -> float:
    """Seconds since this process was created, or since the last run in it closed, if later."""
    return max(0.0, min(_proc_age_s(), time.time() - _last_closed_unix))


def _proc_age_s() -> float:
    # /proc/self/stat field 22 is the start time in clock ticks after boot, on the CLOCK_BOOTTIME
    # clock (/proc/stat's btime is whole seconds only, too coarse for a restart of a few seconds).
    try:
        with open("/proc/self/stat", "rb") as stat_file:
            raw = stat_file.read().decode()
        start_ticks = int(raw[raw.rfind(")") + 2 :].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return 0.0  # not Linux: no restart time can be measured, count none
