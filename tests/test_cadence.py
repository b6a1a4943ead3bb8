"""The fast tier's timer (elastictrain/snapshot/cadence.py): fixed and Young/Daly intervals, on a clock the test moves."""

from __future__ import annotations

import math

import pytest

from elastictrain.snapshot.cadence import COST_KEY, FIRST_INTERVAL_S, FastTierTimer, failures_and_exposure, young_daly_interval_s
from elastictrain.core.events import SnapshotReport
from elastictrain.core.states import State


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def attempt(wall_s: float, preempted: int = 0, **more) -> dict:
    return {"restart_count": 0, "world_size": 2, "start_step": 0, "started_unix": 0.0, "launcher": "torchrun",
            "reason": "fresh", "preempted": preempted, "wall_s": wall_s, **more}


@pytest.mark.parametrize("cost_s, mtbf_s, expected_s", [
    (0.05, 60.0, math.sqrt(6.0)),  # 50 ms a copy, a failure a minute: every 2.45 s
    (0.2, 3600.0, 37.947),  # 200 ms, a failure an hour
    (0.0, 60.0, 0.0),
])
def test_young_daly_interval(cost_s, mtbf_s, expected_s):
    assert young_daly_interval_s(cost_s, mtbf_s) == pytest.approx(expected_s, abs=1e-3)


@pytest.mark.parametrize("attempts, current_s, expected", [
    ([attempt(0.0)], 12.0, (0, 12.0)),  # the first attempt: nothing failed yet
    ([attempt(50.0), attempt(0.0)], 5.0, (1, 55.0)),
    ([attempt(50.0), attempt(40.0, preempted=1), attempt(0.0)], 5.0, (1, 95.0)),  # a preemption loses nothing
    ([attempt(50.0), attempt(40.0), attempt(30.0), attempt(99.0)], 0.0, (3, 120.0)),  # the current one's own record is not used
    # A failure a survivor copy covered lost no work a timed copy could save; its time still counts.
    ([attempt(50.0, survivor_copy=1), attempt(40.0), attempt(0.0)], 5.0, (1, 95.0)),
])
def test_failures_and_exposure_from_the_run_log(attempts, current_s, expected):
    assert failures_and_exposure(attempts, current_s) == expected


def test_a_fixed_interval_counts_from_the_last_fast_copy_of_either_kind():
    clock = Clock()
    timer = FastTierTimer(2.0, clock)
    timer.begin([attempt(0.0)])
    clock.now += 1.9
    assert not timer.due()
    clock.now += 0.1
    assert timer.due()
    timer.transition(State.TRAIN, State.LOCAL_SNAPSHOT, 40)
    assert not timer.due()
    clock.now += 1.5
    timer.transition(State.TRAIN, State.SNAPSHOT, 50)  # a durable snapshot writes a fast copy too
    clock.now += 1.5
    assert not timer.due()
    timer.transition(State.TRAIN, State.EVALUATE, 60)
    clock.now += 0.5
    assert timer.due()


def test_off_is_never_due():
    clock = Clock()
    timer = FastTierTimer(0.0, clock)
    clock.now += 1e6
    assert not timer.enabled and not timer.due()


def test_auto_takes_young_daly_from_the_measured_cost_and_the_runs_failures():
    clock = Clock()
    timer = FastTierTimer("auto", clock)
    # A restart: two earlier attempts failed after 50 s and 40 s of training (up to their last snapshot).
    timer.begin([attempt(50.0), attempt(40.0), attempt(0.0)])
    assert timer.interval_s() == FIRST_INTERVAL_S  # no cost measured yet: an early first copy, to measure it
    clock.now += 30.0
    # Blocked plus written in the background; the durable tier's, and a copy that failed, are not this tier's cost.
    timer.snapshotted(SnapshotReport(10, True, duration_s=0.02, write_s=0.04, tier="local"))
    timer.snapshotted(SnapshotReport(10, True, duration_s=5.0, write_s=5.0, tier="durable"))
    timer.snapshotted(SnapshotReport(11, False, duration_s=5.0, tier="local", error="disk full"))
    assert timer.cost_s() == pytest.approx(0.06)
    mtbf = (50.0 + 40.0 + 30.0) / 2
    assert timer.mtbf_s() == pytest.approx(mtbf)
    assert timer.interval_s() == pytest.approx(math.sqrt(2 * 0.06 * mtbf))
    # The median of the recent costs: one slow write does not move it.
    for duration in (0.02, 0.02, 3.0):
        timer.snapshotted(SnapshotReport(12, True, duration_s=duration, write_s=0.04, tier="local"))
    assert timer.cost_s() == pytest.approx(0.06)


def test_auto_before_any_failure_grows_with_the_time_trained():
    clock = Clock()
    timer = FastTierTimer("auto", clock)
    timer.begin([attempt(0.0)])
    timer.snapshotted(SnapshotReport(5, True, duration_s=0.05, tier="local"))
    clock.now += 60.0
    at_a_minute = timer.interval_s()
    clock.now += 3540.0
    assert at_a_minute == pytest.approx(math.sqrt(2 * 0.05 * 60.0))
    assert timer.interval_s() == pytest.approx(math.sqrt(2 * 0.05 * 3600.0))  # 19 s after an hour without one


def test_auto_starts_from_the_prior_and_moves_toward_the_measured_failure_rate():
    """snapshot.local.mtbf_prior_s: after 1 s of training and 35 ms copies, not a copy every 0.26 s."""
    clock = Clock()
    timer = FastTierTimer("auto", clock, prior_mtbf_s=3600.0)
    timer.begin([attempt(0.0)])
    timer.snapshotted(SnapshotReport(5, True, duration_s=0.035, tier="local"))
    clock.now += 1.0
    assert timer.mtbf_s() == pytest.approx(3601.0)
    assert timer.interval_s() == pytest.approx(math.sqrt(2 * 0.035 * 3601.0))  # about 16 s
    # Three failures in 300 s of training: each moves M from the prior toward the measured 100 s.
    timer.begin([attempt(100.0), attempt(100.0), attempt(100.0), attempt(0.0)])
    assert timer.mtbf_s() == pytest.approx((300.0 + 3600.0) / 4)


def test_auto_after_a_restart_starts_from_the_cost_the_attempt_before_measured_until_its_own_outvote_it():
    """Without it every restarted attempt took an extra copy FIRST_INTERVAL_S in, only to measure the cost again."""
    clock = Clock()
    timer = FastTierTimer("auto", clock, prior_mtbf_s=3600.0)
    timer.begin([attempt(100.0, survivor_copy=1, **{COST_KEY: 0.05}), attempt(0.0, **{COST_KEY: 9.0})])
    assert timer.cost_s() == pytest.approx(0.05)  # the attempt before's, not the current record's own
    assert timer.interval_s() == pytest.approx(math.sqrt(2 * 0.05 * 3700.0))  # about 19 s, not 1 s
    for duration in (0.09, 0.09):  # this attempt's own copies: the median follows them
        timer.snapshotted(SnapshotReport(5, True, duration_s=duration, tier="local"))
    assert timer.cost_s() == pytest.approx(0.09)
    # An earlier attempt that measured nothing (or an older snapshot's record without the key): the early first copy.
    timer.begin([attempt(100.0), attempt(0.0)])
    assert timer.cost_s() is None and timer.interval_s() == FIRST_INTERVAL_S
    # A fixed interval is not moved by it.
    fixed = FastTierTimer(2.0, clock)
    fixed.begin([attempt(100.0, **{COST_KEY: 0.05}), attempt(0.0)])
    assert fixed.cost_s() is None and fixed.interval_s() == 2.0
