"""The watchdog's and the straggler report's decisions as tables, on a fake clock and a real TCPStore.

The processes-and-signals side (SIGSTOP, a loss function that never returns, a slow rank) is in
tests/faults/test_hangs.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from elastictrain.core.events import RunInfo, TrainInterval
from elastictrain.core.processes import proc_stat, stopped_pids
from elastictrain.health.hangs import (
    Heartbeat,
    SilentPeers,
    WatchdogSettings,
    allowance_s,
    diagnose,
    frozen_peers,
    is_stopped_here,
    loop_position,
)
from elastictrain.core.states import State
from elastictrain.observe.stragglers import StragglerReport, StragglerSettings, find_stragglers
from elastictrain.health.watchdog import HUNG_EXIT_CODE, Watchdog

SETTINGS = WatchdogSettings(hang_timeout_s=30, step_multiple=10, first_step_s=600, restore_s=500, evaluate_s=1800, snapshot_s=700)


@pytest.mark.parametrize("state, trained_once, longest_step_s, longest_state_s, expected", [
    (State.TRAIN, False, 0.0, 0.0, 600),  # the first step: warm-up, compilation
    (State.TRAIN, True, 0.01, 0.0, 30),  # fast steps: the timeout itself
    (State.TRAIN, True, 12.0, 0.0, 120),  # a 12 s step: 10 times it, no false alarm
    (State.RESTORE, False, 0.0, 0.0, 500),
    (State.SETUP, False, 0.0, 0.0, 500),
    (State.EVALUATE, True, 0.01, 0.0, 1800),
    (State.EVALUATE, True, 0.01, 400.0, 4000),  # an evaluation seen to take 400 s may take 10 times that
    (State.SNAPSHOT, True, 0.01, 5.0, 700),
    (State.DONE, True, 0.01, 0.0, None),
    (State.PREEMPTED, True, 0.01, 0.0, None),
    (State.FAILED, True, 0.01, 0.0, None),
])
def test_allowance_by_state(state, trained_once, longest_step_s, longest_state_s, expected):
    assert allowance_s(SETTINGS, state, trained_once=trained_once, longest_step_s=longest_step_s,
                       longest_state_s=longest_state_s) == expected


def beat(rank, step=37, state="TRAIN", unix=1000.0, waiting=True, where="torch.autograd.graph:829 in _engine_run_backward"):
    return Heartbeat(rank=rank, step=step, state=state, unix=unix, waiting=waiting, where=where)


STUCK = "tests.helpers.tasks:73 in traced_loss"


@pytest.mark.parametrize("heartbeats, expected", [
    ({0: beat(0), 1: beat(1, unix=990.0)},
     "rank 1 sent no heartbeat for 10.0 s (last in state TRAIN at step 37): frozen, killed or its host is gone"),
    ({0: beat(0), 1: None}, "rank 1 never sent a heartbeat: frozen, killed or its host is gone"),
    ({0: beat(0), 1: beat(1), 2: beat(2, step=36, state="SNAPSHOT")},
     "rank 2 is behind in state SNAPSHOT at step 36 (the others are at step 37)"),
    ({0: beat(0), 1: beat(1, waiting=False, where=STUCK), 2: beat(2)},
     f"rank 1 is stuck in state TRAIN at step 37 at {STUCK} while the others wait for it in a collective"),
    ({0: beat(0), 1: beat(1)},
     "every rank stalled in state TRAIN at step 37, none silent or behind (rank 0 at torch.autograd.graph:829 in "
     "_engine_run_backward; rank 1 at torch.autograd.graph:829 in _engine_run_backward)"),
    # A rank that finished long ago is not a suspect, however old its last heartbeat.
    ({0: beat(0), 1: beat(1, state="DONE", unix=100.0), 2: beat(2, step=30)},
     "rank 2 is behind in state TRAIN at step 30 (the others are at step 37)"),
], ids=["silent", "never", "behind", "busy", "all-waiting", "finished-ignored"])
def test_diagnose_names_the_rank_that_stopped(heartbeats, expected):
    assert diagnose(heartbeats, now_unix=1000.0, stale_after_s=3.0) == expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def info(rank=0, world_size=1, store=None, restart_count=0):
    return RunInfo(rank=rank, local_rank=rank, world_size=world_size, node_rank=0, restart_count=restart_count,
                   launcher="test", run_dir="/tmp", total_steps=100, store=store, round_id="r1")


def watchdog_in_train(settings=SETTINGS):
    """A watchdog driven by hand (no thread): in TRAIN at t=0."""
    clock = FakeClock()
    watchdog = Watchdog(settings, clock=clock)
    watchdog._info = info()
    watchdog.transition(State.SETUP, State.RESTORE, 0)
    watchdog.transition(State.RESTORE, State.TRAIN, 0)
    return watchdog, clock


def test_fast_steps_then_a_stall_fires_after_the_timeout_and_not_before():
    watchdog, clock = watchdog_in_train()
    for step in range(1, 101):  # 100 steps of 10 ms, checked once a second
        clock.now += 0.01
        watchdog.beat(step)
        if step % 100 == 0:
            assert watchdog.check() is None
    stalled_from = clock.now
    clock.now = stalled_from + 29.9
    assert watchdog.check() is None
    clock.now = stalled_from + 30.1
    assert watchdog.check() == "no progress for 30.1 s in state TRAIN at step 100 (allowed 30.0 s)"


def test_a_stall_counts_from_the_loops_last_beat_and_a_warm_up_does_not_delay_reading_the_peers():
    watchdog, clock = watchdog_in_train()
    clock.now = 1.0
    watchdog.beat(1)  # a warm-up: the first step took a second
    assert watchdog.check() is None
    for step in range(2, 12):  # then 10 ms steps, the last at 1.1 s
        clock.now += 0.01
        watchdog.beat(step)
    clock.now = 1.9  # the check that sees them comes 0.8 s after the last one
    assert watchdog.check() is None
    clock.now = 2.0
    watchdog.check()
    # stalled since the last beat (0.9 s), not since the check (0.1 s); overdue at twice the recent 10 ms, not at
    # twice the warm-up's second
    assert watchdog._longest_step_s == pytest.approx(1.0) and watchdog._recent_step_s == pytest.approx(0.01)
    assert watchdog._overdue
    clock.now = 30.0
    assert watchdog.check() is None
    clock.now = 31.2
    assert watchdog.check() == "no progress for 30.1 s in state TRAIN at step 11 (allowed 30.0 s)"


def test_the_first_step_has_its_own_allowance():
    watchdog, clock = watchdog_in_train()
    clock.now = 599.0
    assert watchdog.check() is None  # compiling, warming up
    clock.now = 601.0
    assert "no progress for 601.0 s in state TRAIN at step 0 (allowed 600.0 s)" == watchdog.check()


def test_slow_steps_stretch_the_allowance_so_a_slow_model_is_no_false_alarm():
    watchdog, clock = watchdog_in_train()
    for step in range(1, 4):  # 45 s a step, longer than the 30 s timeout
        clock.now += 45.0
        watchdog.beat(step)
        assert watchdog.check() is None
    clock.now += 449.0
    assert watchdog.check() is None
    clock.now += 2.0
    assert watchdog.check().endswith("(allowed 450.0 s)")


def test_log_intervals_are_progress_marks_when_the_loop_does_not_beat():
    watchdog, clock = watchdog_in_train()
    for step in (25, 50, 75):  # a log interval every 40 s, no beat()
        clock.now += 40.0
        watchdog.trained(TrainInterval(step=step, epoch=0, steps=25, samples=800, elapsed_s=40.0, metrics={},
                                       step_time_s_by_rank=[1.6, 1.6]))
        assert watchdog.check() is None
    clock.now += 399.0
    assert watchdog.check() is None  # 10 x the 40 s between marks
    clock.now += 2.0
    assert "in state TRAIN at step 75 (allowed 400.0 s)" in watchdog.check()


def test_a_snapshot_write_gets_its_own_allowance_and_terminal_states_are_not_watched():
    watchdog, clock = watchdog_in_train()
    clock.now = 1.0
    watchdog.beat(1)
    watchdog.check()
    watchdog.transition(State.TRAIN, State.SNAPSHOT, 1)
    clock.now += 650.0  # an S3 store retrying for minutes
    assert watchdog.check() is None
    clock.now += 51.0
    assert "in state SNAPSHOT at step 1 (allowed 700.0 s)" in watchdog.check()
    watchdog.transition(State.SNAPSHOT, State.DONE, 1)
    clock.now += 10_000.0
    assert watchdog.check() is None


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return dist.PrefixStore("elastictrain/test-run/", server)


def test_a_frozen_peer_is_named_by_the_live_rank_in_one_line_long_before_the_allowance(store, caplog):
    """Rank 1 publishes heartbeats, then freezes (its thread stops); rank 0 stalls, names it and leaves with code 75.

    The allowance is 600 s: a peer whose heartbeat stopped is frozen or gone, not slow, and its silence ends the wait.
    """
    fast = WatchdogSettings(hang_timeout_s=600, heartbeat_every_s=0.1, first_step_s=600)  # silent after 2 s
    exits: list[int] = []
    frozen = Watchdog(fast, on_hang=exits.append)
    frozen.started(info(rank=1, world_size=2, store=store))
    frozen.transition(State.RESTORE, State.TRAIN, 12)
    time.sleep(0.3)
    frozen._stop.set()  # frozen: no more heartbeats, no self-check (a SIGSTOPped process)
    live = Watchdog(fast, on_hang=exits.append)
    with caplog.at_level(logging.ERROR, logger="elastictrain"):
        live.started(info(rank=0, world_size=2, store=store))
        live.transition(State.RESTORE, State.TRAIN, 12)
        # 2-3 s quiet, 4-5 s beside 6 CPU burners; more than 10 s once in the suite beside its torchrun jobs. A bound,
        # not a timing: the allowance is 600 s.
        deadline = time.monotonic() + 60
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    live.stop()
    assert exits == [HUNG_EXIT_CODE]
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert re.match(r"rank 0: no progress for [\d.]+ s in state TRAIN at step 12 and rank 1's heartbeat has not changed "
                    r"for 2\.\d s; rank 1 sent no heartbeat for", line), line
    assert "(last in state TRAIN at step 12): frozen, killed or its host is gone; exiting with code 75" in line
    assert store.get("watchdog/round-r1/hang").decode().startswith("rank 0 found a hang: rank 1 sent no heartbeat")


def test_a_peer_verdict_makes_a_stalled_rank_leave_before_its_own_allowance(store):
    """Once a rank has found a hang, a peer stalled for half its allowance leaves too, naming what it found."""
    store.set("watchdog/round-r1/hang", "rank 1 found a hang: rank 1 is stuck in state TRAIN at step 5 at x:1 in f")
    watchdog = Watchdog(WatchdogSettings(hang_timeout_s=30), clock=FakeClock())
    watchdog._info = info(rank=0, world_size=2, store=store)
    watchdog.transition(State.RESTORE, State.TRAIN, 5)
    watchdog._clock.now = 601.0
    watchdog._trained_once = True
    watchdog._last_progress = 586.0
    assert watchdog.check() is None  # 15 s stalled: not yet half of 30 s
    watchdog._clock.now = 602.0
    assert watchdog.check() == ("no progress for 16.0 s in state TRAIN at step 5 and rank 1 found a hang: rank 1 is stuck in "
                                "state TRAIN at step 5 at x:1 in f")


def test_the_heartbeat_says_where_the_loop_thread_is_and_whether_it_waits(store):
    release = threading.Event()
    watchdog = Watchdog(WatchdogSettings(heartbeat_every_s=60))

    def loop():  # the thread that calls started() is the one watched
        watchdog.started(info(rank=0, world_size=1, store=store))
        release.wait()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not store.check(["watchdog/round-r1/rank-0"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        now = watchdog.heartbeat()
        published = Heartbeat.from_json(store.get("watchdog/round-r1/rank-0"))
    finally:
        release.set()
        thread.join()
        watchdog.stop()
    assert published.rank == 0 and published.state == "SETUP"
    assert now.where.startswith("threading:") and now.where.endswith("in wait") and not now.waiting


@pytest.mark.parametrize("module, waiting", [
    ("elastictrain.dist.collectives", True),  # a broadcast or all-reduce of elastictrain's own
    ("elastictrain.dist.ddp", True),  # DDP's construction broadcasts the parameters
    ("elastictrain.dist.group", True),  # setup and teardown: the process group forms and ends together
    ("torch.distributed.distributed_c10d", True),
    ("tests.helpers.tasks", False),  # user code: a rank stuck there holds the others up
])
def test_a_loop_thread_blocked_inside_a_module_that_waits_for_peers_counts_as_waiting(module, waiting):
    namespace = {"__name__": module}
    exec("import time\ndef blocked(released):\n    while not released:\n        time.sleep(0.01)\n", namespace)
    released: list[bool] = []
    thread = threading.Thread(target=namespace["blocked"], args=(released,))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "in blocked" not in loop_position(thread.ident)[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        where, found_waiting = loop_position(thread.ident)
    finally:
        released.append(True)
        thread.join()
    assert where.startswith(f"{module}:") and where.endswith("in blocked")
    assert found_waiting is waiting


# -- stragglers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("compute, expected", [
    ([0.010, 0.030], [1]),  # two ranks: each against the other, not the midpoint
    ([0.010, 0.019], []),
    ([0.010, 0.011, 0.010, 0.050], [3]),
    ([0.030, 0.010, 0.010, 0.031], [0, 3]),
    ([0.001, 0.0025], []),  # 2.5x, but 1.5 ms: scheduler noise
    ([0.02], []),
])
def test_find_stragglers_against_the_other_ranks_median(compute, expected):
    assert [s.rank for s in find_stragglers(compute, factor=2.0, min_excess_s=0.005)] == expected


def test_the_report_names_a_slow_rank_once_per_interval_at_most_and_again_after_the_repeat_time(caplog):
    clock = FakeClock()
    report = StragglerReport(StragglerSettings(factor=2.0, repeat_after_s=300), clock=clock)
    report.started(info(rank=0, world_size=2))
    with caplog.at_level(logging.WARNING, logger="elastictrain"):
        for step in range(10, 310, 10):  # 30 intervals, 10 s apart, rank 1 slow in all
            clock.now += 10
            report.observe(step, [0.05, 0.05], [0.04, 0.0])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + 0, lines  # 300 s have not passed since the first warning (at t=10) until t=300
    assert lines[0].startswith("straggler at step 10: rank 1: 50.0 ms per step, 5.0x the others' median 10.0 ms;")
    clock.now += 10
    with caplog.at_level(logging.WARNING, logger="elastictrain"):
        report.observe(310, [0.05, 0.05], [0.04, 0.0])
    assert len(caplog.records) == 2


def test_without_measured_waits_the_report_compares_step_times_and_other_ranks_stay_quiet(caplog):
    quiet = StragglerReport()
    quiet.started(info(rank=1, world_size=2))
    report = StragglerReport()
    report.started(info(rank=0, world_size=2))
    with caplog.at_level(logging.WARNING, logger="elastictrain"):
        quiet.observe(10, [0.01, 0.05])
        report.observe(10, [0.01, 0.05, 0.01])
    [line] = [r.getMessage() for r in caplog.records]
    assert "rank 1: 50.0 ms per step" in line and "(by step time;" in line


def test_a_peer_is_silent_when_its_heartbeat_stays_the_same_by_our_clock_whatever_its_clock_says():
    """Silence is timed by the reader's clock: a peer whose clock is an hour off is not silent while it publishes."""
    clock = FakeClock()
    silence = SilentPeers(clock)
    skewed = beat(1, unix=1000.0 - 3600)  # its host's clock is an hour behind ours
    assert silence.update({1: skewed, 2: None}) == []
    clock.now = 2.0
    assert silence.update({1: beat(1, unix=1001.0 - 3600), 2: None}) == []  # published again: alive
    clock.now = 5.5
    assert silence.update({1: beat(1, unix=1001.0 - 3600), 2: beat(2, state="DONE")}) == [(beat(1, unix=1001.0 - 3600), 3.5)]
    silence.forget()
    assert silence.update({1: beat(1, unix=1001.0 - 3600)}) == []  # progress forgets: silence is counted afresh


def test_diagnose_names_a_stopped_rank_on_this_host_as_silent_before_its_heartbeat_is_stale():
    heartbeats = {0: beat(0), 1: beat(1, unix=998.5)}
    assert diagnose(heartbeats, now_unix=1000.0, stale_after_s=3.0).startswith("every rank stalled")
    assert diagnose(heartbeats, now_unix=1000.0, stale_after_s=3.0, stopped=frozenset({1})) == (
        "rank 1 sent no heartbeat for 1.5 s (last in state TRAIN at step 37): frozen, killed or its host is gone")


@pytest.mark.parametrize("unchanged_s, stalled_s, stopped, frozen", [
    (0.25, 0.5, True, True),  # a stopped process on this host, its heartbeat seen unchanged at two polls: frozen now
    (0.25, 0.5, False, False),  # a slow or busy rank whose heartbeat lagged one poll: not yet
    (2.9, 4.0, False, False),
    (3.0, 4.0, False, True),  # stale: frozen, killed or its host is gone, wherever it runs
    (3.0, 4.0, True, True),
    (3.5, 3.5, False, False),  # read from the first poll: staleness counts from a heartbeat period into the stall
    (3.5, 4.0, False, True),
], ids=["stopped-at-second-poll", "slow-one-poll", "slow-nearly-stale", "stale", "stale-and-stopped",
        "stale-too-early-in-the-stall", "stale-a-period-into-the-stall"])
def test_frozen_peers_a_stopped_peer_at_its_second_read_any_other_only_when_stale(unchanged_s, stalled_s, stopped, frozen):
    silent = [(beat(1), unchanged_s)]
    assert frozen_peers(silent, 3.0, lambda b: stopped, stalled_s, heartbeat_every_s=1.0) == (silent if frozen else [])


@pytest.fixture
def two_peer_processes():
    """Two real processes on this host standing in for peer ranks: one SIGSTOPped (frozen), one running (slow)."""
    frozen = subprocess.Popen(["sleep", "60"])
    slow = subprocess.Popen(["sleep", "60"])
    os.kill(frozen.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while proc_stat(frozen.pid)[0] not in ("T", "t") and time.monotonic() < deadline:
        time.sleep(0.01)
    yield frozen.pid, slow.pid
    for proc in (frozen, slow):
        proc.kill()
        proc.wait()


def peer_beat(rank, pid, unix=1000.0):
    return Heartbeat(rank=rank, step=37, state="TRAIN", unix=unix, waiting=True, where="x:1 in f", pid=pid,
                     host=socket.gethostname(), start_ticks=proc_stat(pid)[1])


def test_a_stopped_process_on_this_host_is_told_from_a_running_one(two_peer_processes):
    frozen_pid, slow_pid = two_peer_processes
    assert is_stopped_here(peer_beat(1, frozen_pid))
    assert not is_stopped_here(peer_beat(2, slow_pid))
    assert not is_stopped_here(Heartbeat(**{**peer_beat(1, frozen_pid).__dict__, "start_ticks": 1}))  # a later process
    assert not is_stopped_here(Heartbeat(**{**peer_beat(1, frozen_pid).__dict__, "host": "another-host"}))


def test_the_stopped_workers_are_told_from_running_ones_and_from_gone_ones(two_peer_processes):
    """What elastictrain-run's agent and the warm-start client SIGKILL instead of a SIGTERM the process cannot act on."""
    frozen_pid, slow_pid = two_peer_processes
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert stopped_pids([frozen_pid, slow_pid, gone.pid]) == [frozen_pid]
    os.kill(frozen_pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while stopped_pids([frozen_pid]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stopped_pids([frozen_pid, slow_pid]) == []  # continued: it can act on a SIGTERM again


def test_an_overdue_rank_names_a_stopped_peer_at_its_second_poll_and_a_running_one_only_when_stale(store, two_peer_processes):
    """Rank 0 is stalled; rank 1 is a SIGSTOPped process, rank 2 a running one, neither publishing (a slow rank's
    heartbeat thread can lag under load). The stopped one ends the wait at the second poll; the running one only
    when its heartbeat is stale, a heartbeat period into the stall."""
    frozen_pid, slow_pid = two_peer_processes

    def watchdog(peers):
        clock = FakeClock()
        dog = Watchdog(WatchdogSettings(hang_timeout_s=600, heartbeat_every_s=1), clock=clock)
        dog._info = info(rank=0, world_size=2, store=store)
        store.set("watchdog/round-r1/rank-1", peer_beat(1, peers).to_json())
        dog.transition(State.RESTORE, State.TRAIN, 37)
        dog._trained_once, dog._longest_step_s = True, 0.01
        return dog, clock

    dog, clock = watchdog(frozen_pid)
    clock.now = 0.2
    assert dog.check() is None and not dog._overdue  # not yet a poll into the stall: the peers are not read
    clock.now = 0.3
    assert dog.check() is None and dog._overdue  # first read of the heartbeat; from now on a check every poll
    clock.now = 0.6
    assert dog.check() == ("no progress for 0.6 s in state TRAIN at step 37 and rank 1's heartbeat has not changed for "
                           "0.3 s and its process is stopped on this host")
    assert "frozen, killed or its host is gone (rank 1 is stopped process" in dog._diagnose()

    dog, clock = watchdog(slow_pid)
    for now in (0.3, 0.6, 1.0, 2.0, 3.0, 3.75):
        clock.now = now
        assert dog.check() is None
    clock.now = 4.0
    assert dog.check() == "no progress for 4.0 s in state TRAIN at step 37 and rank 1's heartbeat has not changed for 3.7 s"


@pytest.mark.parametrize("loop_leaves", [True, False])
def test_after_killing_a_stopped_peer_the_loop_thread_leaves_through_its_failure_path_or_the_watchdog_exits(
        store, two_peer_processes, loop_leaves):
    """The kill fails this rank's blocked collective at once; its failure path (a survivor copy of the step) stops the
    watchdog and ends the process. The watchdog leaves as hung only if that has not happened within its grace."""
    frozen_pid, _ = two_peer_processes
    exits: list[int] = []
    dog = Watchdog(WatchdogSettings(hang_timeout_s=600, heartbeat_every_s=1), on_hang=exits.append)
    dog.leave_grace_s = 0.5
    dog._info = info(rank=0, world_size=2, store=store)
    store.set("watchdog/round-r1/rank-1", peer_beat(1, frozen_pid).to_json())
    dog._silent_peers = [(peer_beat(1, frozen_pid), 3.0)]
    if loop_leaves:
        threading.Timer(0.1, dog._stop.set).start()  # the loop thread's failure path stopping the watchdog
    dog._fire("no progress")
    deadline = time.monotonic() + 5
    while (proc_stat(frozen_pid) or ("gone",))[0] not in ("Z", "X", "gone") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (proc_stat(frozen_pid) or ("gone",))[0] in ("Z", "X", "gone"), "the stopped peer is SIGKILLed"
    assert exits == ([] if loop_leaves else [HUNG_EXIT_CODE])
