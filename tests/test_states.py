"""The state machine's table and the pure decision function, tested as tables: no processes."""

from __future__ import annotations

import logging

import pytest

from elastictrain.train.plan import Plan, decide
from elastictrain.core.progress import Progress
from elastictrain.core.states import ALLOWED, TERMINAL, IllegalTransition, State, StateMachine
from elastictrain.dist.vote import Requests


def test_every_state_has_a_row_and_terminals_lead_nowhere():
    assert set(ALLOWED) == set(State)
    for state in TERMINAL:
        assert ALLOWED[state] == frozenset()
    for state in set(State) - TERMINAL:
        assert State.FAILED in ALLOWED[state]


def test_legal_path_is_logged_with_step_and_fires_hooks(caplog):
    machine = StateMachine()
    fired = []
    machine.on(State.TRAIN, State.SNAPSHOT)(lambda s, d, step: fired.append(("edge", step)))
    machine.on(dst=State.DONE)(lambda s, d, step: fired.append(("done", s.name, step)))
    machine.on()(lambda s, d, step: fired.append(("any", d.name)))
    with caplog.at_level(logging.INFO, logger="elastictrain"):
        for dst, step in [(State.RESTORE, 0), (State.TRAIN, 0), (State.SNAPSHOT, 100), (State.DONE, 100)]:
            machine.transition(dst, step)
    assert "state TRAIN -> SNAPSHOT at step 100" in caplog.text
    assert ("edge", 100) in fired and ("done", "SNAPSHOT", 100) in fired
    assert [f[1] for f in fired if f[0] == "any"] == ["RESTORE", "TRAIN", "SNAPSHOT", "DONE"]
    assert machine.finished


@pytest.mark.parametrize(
    "path, bad",
    [([], State.TRAIN), ([State.RESTORE, State.TRAIN], State.RESTORE), ([State.RESTORE, State.DONE], State.TRAIN),
     ([State.RESTORE, State.PREEMPTED], State.SNAPSHOT)],
)
def test_illegal_transition_raises_naming_both_states(path, bad):
    machine = StateMachine()
    for dst in path:
        machine.transition(dst, 0)
    with pytest.raises(IllegalTransition, match=f"{machine.state.name} -> {bad.name}"):
        machine.transition(bad, 7)


NONE, TIMER, PREEMPT = Requests(), Requests(snapshot=True), Requests(preempt=True)
FAST_TIMER = Requests(local_snapshot=True)  # rank 0's fast-tier timer (snapshot.local.every_s)
ANOMALY = Requests(anomaly=True)
PLAN = Plan(max_epochs=2, max_steps=None, eval_every_epochs=1, has_val_data=True, snapshot_every_steps=10, snapshot_on_done=True)
FAST = Plan(2, None, 1, True, 10, True, local_every_steps=4)  # the fast tier every 4 steps too


def progress(**counters) -> Progress:
    p = Progress()
    p.load_state_dict({**p.state_dict(), **counters})
    return p


@pytest.mark.parametrize(
    "counters, plan, requested, expected",
    [
        ({}, PLAN, NONE, State.TRAIN),  # fresh start
        ({"global_step": 7, "epoch_offset": 7}, PLAN, NONE, State.TRAIN),
        ({"global_step": 10, "epoch_offset": 10}, PLAN, NONE, State.SNAPSHOT),  # every 10 steps
        ({"global_step": 10, "epoch_offset": 10, "last_snapshot_step": 10}, PLAN, NONE, State.TRAIN),  # just taken
        ({"global_step": 7, "epoch_offset": 7}, PLAN, TIMER, State.SNAPSHOT),  # timer fired
        ({"global_step": 12, "epoch": 1}, PLAN, NONE, State.EVALUATE),  # epoch boundary
        ({"global_step": 12, "epoch": 1, "last_evaluated_step": 12}, PLAN, NONE, State.TRAIN),
        ({"global_step": 20, "epoch": 1, "last_evaluated_step": 20}, PLAN, NONE, State.SNAPSHOT),  # eval then snapshot
        ({"global_step": 24, "epoch": 2}, PLAN, NONE, State.EVALUATE),  # finished: final eval first
        ({"global_step": 24, "epoch": 2, "last_evaluated_step": 24}, PLAN, NONE, State.SNAPSHOT),  # then final snapshot
        ({"global_step": 24, "epoch": 2, "last_evaluated_step": 24, "last_snapshot_step": 24}, PLAN, NONE, State.DONE),
        ({"global_step": 5, "epoch_offset": 5}, Plan(9, 5, 1, True, 0, False), NONE, State.EVALUATE),  # max_steps
        ({"global_step": 5, "epoch_offset": 5, "last_evaluated_step": 5}, Plan(9, 5, 1, True, 0, False), NONE, State.DONE),
        ({"global_step": 12, "epoch": 1}, Plan(2, None, 0, True, 0, True), NONE, State.TRAIN),  # eval only at the end
        ({"global_step": 24, "epoch": 2}, Plan(2, None, 1, False, 0, False), NONE, State.DONE),  # no val data
        # a snapshot taken at this step that failed to commit is not retried at once
        ({"global_step": 10, "epoch_offset": 10, "last_snapshot_step": 10}, PLAN, TIMER, State.TRAIN),
        # preemption: a snapshot of this very step, then PREEMPTED; nothing is due before it
        ({"global_step": 7, "epoch_offset": 7}, PLAN, PREEMPT, State.SNAPSHOT),
        ({"global_step": 7, "epoch_offset": 7, "last_snapshot_step": 7}, PLAN, PREEMPT, State.PREEMPTED),
        ({}, PLAN, PREEMPT, State.PREEMPTED),  # before the first step there is nothing to save
        ({"global_step": 12, "epoch": 1}, PLAN, PREEMPT, State.SNAPSHOT),  # the epoch's evaluation waits
        ({"global_step": 24, "epoch": 2, "last_evaluated_step": 24, "last_snapshot_step": 24}, PLAN, PREEMPT,
         State.PREEMPTED),
        ({"global_step": 7, "epoch_offset": 7}, PLAN, PREEMPT | TIMER, State.SNAPSHOT),
        ({}, PLAN, TIMER, State.TRAIN),  # a fresh start needs no timed snapshot at step 0
        # the fast tier: every local_every_steps, or when rank 0's timer fired
        ({"global_step": 8, "epoch_offset": 8}, FAST, NONE, State.LOCAL_SNAPSHOT),
        ({"global_step": 8, "epoch_offset": 8, "last_local_snapshot_step": 8}, FAST, NONE, State.TRAIN),
        ({"global_step": 7, "epoch_offset": 7}, FAST, NONE, State.TRAIN),
        ({"global_step": 7, "epoch_offset": 7}, FAST, FAST_TIMER, State.LOCAL_SNAPSHOT),
        ({"global_step": 7, "epoch_offset": 7}, PLAN, FAST_TIMER, State.LOCAL_SNAPSHOT),  # the timer alone
        ({"global_step": 7, "epoch_offset": 7, "last_local_snapshot_step": 7}, PLAN, FAST_TIMER, State.TRAIN),
        ({}, PLAN, FAST_TIMER, State.TRAIN),  # nothing to copy at step 0
        ({"global_step": 10, "epoch_offset": 10}, PLAN, FAST_TIMER, State.SNAPSHOT),  # a durable one is a fast one too
        ({"global_step": 7, "epoch_offset": 7}, PLAN, FAST_TIMER | TIMER, State.SNAPSHOT),
        ({"global_step": 7, "epoch_offset": 7}, PLAN, FAST_TIMER | PREEMPT, State.SNAPSHOT),
        ({"global_step": 12, "epoch": 1}, PLAN, FAST_TIMER, State.EVALUATE),  # the epoch's evaluation first
        # finished: the final snapshot, never a fast copy the run is about to give back
        ({"global_step": 24, "epoch": 2, "last_evaluated_step": 24, "last_snapshot_step": 24}, PLAN, FAST_TIMER,
         State.DONE),
        ({"global_step": 24, "epoch": 2, "last_evaluated_step": 24}, Plan(2, None, 1, True, 0, False), FAST_TIMER,
         State.DONE),
        # an anomaly some rank saw: ROLLBACK before anything that would start from that step
        ({"global_step": 7, "epoch_offset": 7}, PLAN, ANOMALY, State.ROLLBACK),
        ({"global_step": 10, "epoch_offset": 10}, PLAN, ANOMALY, State.ROLLBACK),  # not the snapshot of a bad step
        ({"global_step": 12, "epoch": 1}, PLAN, ANOMALY | FAST_TIMER, State.ROLLBACK),  # nor its evaluation
        ({"global_step": 7, "epoch_offset": 7}, PLAN, ANOMALY | PREEMPT, State.ROLLBACK),  # the preemption waits
        ({"global_step": 24, "epoch": 2}, PLAN, ANOMALY, State.ROLLBACK),  # nor its end
    ],
)
def test_decide(counters, plan, requested, expected):
    assert decide(progress(**counters), plan, requested) is expected
