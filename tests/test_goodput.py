"""Goodput accounting driven by scripted event sequences on a fake clock; recompute from a real TCPStore."""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch.distributed as tdist

from elastictrain.observe import goodput as goodput_module
from elastictrain.core.events import RunInfo, TrainInterval
from elastictrain.observe.goodput import CAUSES, HIGH_WATER_KEY, Goodput
from elastictrain.core.states import State

S = State


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_info(rank: int = 0, restart_count: int = 0, store=None) -> RunInfo:
    return RunInfo(rank, rank, 2, 0, restart_count, "torchrun", "/tmp/run", 100, store)


def interval(step: int, steps: int = 25) -> TrainInterval:
    return TrainInterval(step=step, epoch=0, steps=steps, samples=steps * 32, elapsed_s=1.0, metrics={"train_loss": 1.0})


def play(goodput: Goodput, clock: FakeClock, script: list[tuple]) -> None:
    """Each entry: (seconds later, event name, *args)."""
    for after_s, event, *args in script:
        clock.now += after_s
        getattr(goodput, event)(*args)


# A fresh attempt: 1 s set-up (not counted: no restart), 0.5 s restore, 2 + 0.5 s training,
# a 0.5 s snapshot, 2 s more training, 1 s evaluation.
FRESH_RUN = [
    (1.0, "transition", S.SETUP, S.RESTORE, 0),
    (0.5, "restored", 0, 0.5, False),
    (0.0, "transition", S.RESTORE, S.TRAIN, 0),
    (2.0, "trained", interval(25)),
    (0.5, "transition", S.TRAIN, S.SNAPSHOT, 25),
    (0.5, "transition", S.SNAPSHOT, S.TRAIN, 25),
    (2.0, "trained", interval(50)),
    (0.0, "transition", S.TRAIN, S.EVALUATE, 50),
    (1.0, "transition", S.EVALUATE, S.DONE, 50),
    (0.0, "closed"),
]


@pytest.mark.parametrize(
    ("restart_count", "restored_from_snapshot", "expected"),
    [
        # First attempt, nothing restored: start-up is nobody's fault, restart = 0.
        (0, False, {"productive": 4.5, "snapshot": 0.5, "restore": 0.5, "evaluate": 1.0, "restart": 0.0, "recompute": 0.0, "rollback": 0.0}),
        # torchrun restarted us: process start (7 s ago at the first transition) to the first transition.
        (1, False, {"productive": 4.5, "snapshot": 0.5, "restore": 0.5, "evaluate": 1.0, "restart": 7.0, "recompute": 0.0, "rollback": 0.0}),
        # A relaunched job (restart count 0) that restored a snapshot also paid for its restart.
        (0, True, {"productive": 4.5, "snapshot": 0.5, "restore": 0.5, "evaluate": 1.0, "restart": 7.0, "recompute": 0.0, "rollback": 0.0}),
    ],
)
def test_seconds_by_cause_for_a_scripted_attempt(restart_count, restored_from_snapshot, expected):
    clock = FakeClock()
    goodput = Goodput(clock=clock, process_age_s=lambda: 7.0)
    goodput.started(run_info(restart_count=restart_count))
    script = [entry if entry[1] != "restored" else (0.5, "restored", 0, 0.5, restored_from_snapshot) for entry in FRESH_RUN]
    play(goodput, clock, script)
    assert goodput.seconds_by_cause() == pytest.approx(expected)
    assert goodput.goodput_ratio() == pytest.approx(4.5 / sum(expected.values()))


def test_a_rollback_counts_its_state_as_rollback_and_the_steps_it_replays_as_recompute():
    clock = FakeClock()
    goodput = Goodput(clock=clock, process_age_s=lambda: 0.0)
    goodput.started(run_info())
    play(goodput, clock, [
        (0.0, "transition", S.SETUP, S.RESTORE, 0),
        (0.5, "restored", 0, 0.5, False),
        (0.0, "transition", S.RESTORE, S.TRAIN, 0),
        (4.0, "transition", S.TRAIN, S.ROLLBACK, 40),  # an anomaly: steps 1-40 trained
        (0.5, "rolled_back", 40, 30, 0.5),
        (0.0, "transition", S.ROLLBACK, S.TRAIN, 30),
        (2.0, "trained", interval(50, steps=20)),  # steps 31-50: 31-40 again, then 41-50
    ])
    seconds = goodput.seconds_by_cause()
    assert seconds["rollback"] == pytest.approx(0.5)
    assert seconds["recompute"] == pytest.approx(1.0)
    assert seconds["productive"] == pytest.approx(4.0 + 1.0)


def test_counters_stay_monotonic_across_a_restart_through_the_snapshot():
    clock = FakeClock()
    first = Goodput(clock=clock, process_age_s=lambda: 0.0)
    first.started(run_info())
    play(first, clock, FRESH_RUN[:5])  # ... training to step 25, then into SNAPSHOT at 25
    clock.now += 0.25
    saved = first.state_dict()  # taken while the snapshot is being written
    # The snapshot being written counts up to the moment its state was captured.
    assert saved["seconds_by_cause"]["snapshot"] == pytest.approx(0.25)
    play(first, clock, FRESH_RUN[5:7])  # the first attempt trains on, then is killed: closed() never comes
    before_kill = first.seconds_by_cause()

    second = Goodput(clock=clock, process_age_s=lambda: 3.0)
    second.started(run_info(restart_count=1))
    play(second, clock, [(1.0, "transition", S.SETUP, S.RESTORE, 0)])
    second.load_state_dict(saved)
    play(second, clock, [(0.5, "restored", 25, 0.5, True), (0.0, "transition", S.RESTORE, S.TRAIN, 25), (2.0, "trained", interval(50))])
    after = second.seconds_by_cause()
    for cause in CAUSES:
        assert after[cause] >= saved["seconds_by_cause"][cause], cause
    # Saved totals + this attempt: 3 s restart, 0.5 s restore, 2 s training (no store: productive).
    assert after["restart"] == pytest.approx(3.0)
    assert after["restore"] == pytest.approx(0.5 + 0.5)
    assert after["productive"] == pytest.approx(2.5 + 2.0)
    # What the killed attempt did after its snapshot is lost from the counters (2 s of training).
    assert before_kill["productive"] == pytest.approx(2.5 + 2.0)


@pytest.fixture
def tcp_store():
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    yield tdist.PrefixStore("elastictrain/test-run/", store)
    del store


def test_recompute_counted_from_the_high_water_mark_in_a_real_store(tcp_store):
    clock = FakeClock()
    # Attempt 0 (rank 0 writes the store) trains to step 80 and dies; its last snapshot was at step 50.
    first = Goodput(clock=clock, process_age_s=lambda: 0.0)
    first.started(run_info(store=tcp_store))
    play(first, clock, [(0.0, "transition", S.SETUP, S.RESTORE, 0), (0.0, "transition", S.RESTORE, S.TRAIN, 0)])
    for step in (25, 50, 75, 80):
        play(first, clock, [(1.0, "trained", interval(step, steps=step % 25 or 25))])
    assert tcp_store.get(HIGH_WATER_KEY) == b"80"

    # Attempt 1, rank 1 (reads, never writes) and rank 0, restore step 50 and train 50 -> 100 in 10 s.
    for rank in (1, 0):
        clock = FakeClock()
        attempt = Goodput(clock=clock, process_age_s=lambda: 0.0)
        attempt.started(run_info(rank=rank, restart_count=1, store=tcp_store))
        play(attempt, clock, [
            (0.0, "transition", S.SETUP, S.RESTORE, 0),
            (0.0, "restored", 50, 0.0, True),
            (0.0, "transition", S.RESTORE, S.TRAIN, 50),
            (4.0, "trained", interval(70, steps=20)),  # steps 51..70: all recompute
            (6.0, "trained", interval(100, steps=30)),  # steps 71..100: 10 of 30 recompute
        ])
        seconds = attempt.seconds_by_cause()
        assert seconds["recompute"] == pytest.approx(4.0 + 6.0 * 10 / 30)
        assert seconds["productive"] == pytest.approx(6.0 * 20 / 30)
        assert tcp_store.get(HIGH_WATER_KEY) == (b"80" if rank == 1 else b"100")


def test_the_high_water_mark_follows_the_steps_between_log_intervals(tcp_store):
    """A kill between two log intervals: the next attempt counts every step rank 0 reached up to a second before."""
    clock = FakeClock()
    attempt = Goodput(clock=clock, process_age_s=lambda: 0.0)
    attempt.started(run_info(store=tcp_store))
    play(attempt, clock, [(0.0, "transition", S.SETUP, S.RESTORE, 0), (0.0, "transition", S.RESTORE, S.TRAIN, 0)])
    for step in range(1, 38):  # 1/8 s steps, killed after step 37: the log interval (25) was at step 25
        play(attempt, clock, [(0.125, "stepped", step)] + ([(0.0, "trained", interval(25))] if step == 25 else []))
    assert tcp_store.get(HIGH_WATER_KEY) == b"33"  # written at step 33, one second after the log interval's write
    clock.now += 0.25
    attempt.stepped(38)
    assert tcp_store.get(HIGH_WATER_KEY) == b"33", "at most one write a second"


def test_the_high_water_mark_never_goes_down(tcp_store):
    tcp_store.set(HIGH_WATER_KEY, "80")
    clock = FakeClock()
    attempt = Goodput(clock=clock, process_age_s=lambda: 0.0)
    attempt.started(run_info(restart_count=2, store=tcp_store))
    play(attempt, clock, [
        (0.0, "transition", S.SETUP, S.RESTORE, 0),
        (0.0, "transition", S.RESTORE, S.TRAIN, 25),
        (1.0, "trained", interval(50)),
    ])
    assert tcp_store.get(HIGH_WATER_KEY) == b"80"


def test_without_a_store_retraining_counts_as_productive():
    clock = FakeClock()
    attempt = Goodput(clock=clock, process_age_s=lambda: 0.0)
    attempt.started(run_info(restart_count=1, store=None))
    play(attempt, clock, [
        (0.0, "transition", S.SETUP, S.RESTORE, 0),
        (0.0, "transition", S.RESTORE, S.TRAIN, 50),
        (3.0, "trained", interval(75)),
    ])
    assert attempt.seconds_by_cause()["recompute"] == 0.0
    assert attempt.seconds_by_cause()["productive"] == pytest.approx(3.0)


@pytest.mark.slow
def test_process_age_counts_from_process_creation_or_the_last_run_in_it():
    # A fresh interpreter that waits 0.3 s has been alive at least that long.
    code = "import time; time.sleep(0.3); from elastictrain.observe.goodput import process_age_s_now; print(process_age_s_now())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert age >= 0.3
    # In this long-lived test process, a run that just closed resets the start of the next one.
    Goodput().closed()
    assert goodput_module.process_age_s_now() < goodput_module._proc_age_s()


def test_an_attempt_that_ends_writes_the_step_it_reached_and_a_rollback_the_step_it_rolled_back_from(tcp_store):
    """A peer lost between two writes: rank 0 survives it and writes its step as it ends, so the restart counts the
    steps it redoes; after a rollback the high-water mark is the step rolled back from, not the replay's."""
    clock = FakeClock()
    attempt = Goodput(clock=clock, process_age_s=lambda: 0.0)
    attempt.started(run_info(store=tcp_store))
    play(attempt, clock, [(0.0, "transition", S.SETUP, S.RESTORE, 0), (0.0, "transition", S.RESTORE, S.TRAIN, 0)])
    for step in range(1, 38):
        play(attempt, clock, [(0.125, "stepped", step)])
    assert tcp_store.get(HIGH_WATER_KEY) == b"32"
    play(attempt, clock, [(0.125, "transition", S.TRAIN, S.FAILED, 37)])
    attempt.closed()
    assert tcp_store.get(HIGH_WATER_KEY) == b"37"

    clock = FakeClock()
    second = Goodput(clock=clock, process_age_s=lambda: 0.0)
    second.started(run_info(restart_count=1, store=tcp_store))
    play(second, clock, [
        (0.0, "transition", S.SETUP, S.RESTORE, 0),
        (0.0, "restored", 30, 0.0, True),
        (0.0, "transition", S.RESTORE, S.TRAIN, 30),
        (4.0, "trained", interval(50, steps=20)),  # steps 31..50: 7 of 20 recompute; 50 written
        (0.1, "stepped", 51), (0.1, "stepped", 52), (0.1, "stepped", 53),  # within the second: not written
        (0.0, "transition", S.TRAIN, S.ROLLBACK, 53),
        (0.0, "rolled_back", 53, 45, 0.0),
        (0.0, "transition", S.ROLLBACK, S.TRAIN, 45),
    ])
    assert second.seconds_by_cause()["recompute"] == pytest.approx(4.0 * 7 / 20)
    assert tcp_store.get(HIGH_WATER_KEY) == b"50"
    play(second, clock, [(1.5, "stepped", 46)])
    assert tcp_store.get(HIGH_WATER_KEY) == b"53", "the replay's step 46: the mark is the step rolled back from"


class GoneStore:
    """The launcher's store after its agent exited: every write fails (torch: a broken pipe, with a warning)."""

    def __init__(self) -> None:
        self.writes = 0

    def check(self, keys) -> bool:
        return False

    def set(self, key, value) -> None:
        self.writes += 1
        raise tdist.DistNetworkError("Broken pipe")


def test_a_store_gone_with_its_agent_stops_the_high_water_writes_and_the_counting_goes_on():
    clock, store = FakeClock(), GoneStore()
    goodput = Goodput(clock=clock, process_age_s=lambda: 0.0)
    goodput.started(run_info(store=store))
    play(goodput, clock, [(0.0, "transition", S.SETUP, S.RESTORE, 0), (0.0, "transition", S.RESTORE, S.TRAIN, 0),
                          (1.0, "trained", interval(25)), (2.0, "stepped", 30), (1.0, "trained", interval(50)),
                          (0.0, "closed")])
    assert store.writes == 1, "one failed write, then none"
    assert goodput.seconds_by_cause()["productive"] == pytest.approx(1.0 + 2.0 + 1.0)
