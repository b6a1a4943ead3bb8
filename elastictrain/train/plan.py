"""What follows each state: ``decide``, pure and table-tested (tests/test_states.py).

From the progress counters, the parts of the config that shape the run (``Plan``) and the
requests every rank agreed on, ``decide`` says what comes after RESTORE, TRAIN, EVALUATE or
SNAPSHOT, so every rank takes the same path and a resumed worker takes the path an unbroken
one would.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.core.config import Config
from elastictrain.core.progress import Progress
from elastictrain.core.states import State
from elastictrain.dist.vote import Requests


@dataclass(frozen=True)
class Plan:
    """The parts of the config that decide the path through the states."""

    max_epochs: int
    max_steps: int | None
    eval_every_epochs: int
    has_val_data: bool
    snapshot_every_steps: int
    snapshot_on_done: bool
    local_every_steps: int = 0  # the fast tier's interval (0: off)

    @classmethod
    def of(cls, cfg: Config, *, epochs: bool, evaluates: bool, fast_tier: bool) -> Plan:
        """A run without data (``epochs`` False) has no epochs to end it: train.max_steps does."""
        train, snapshot = cfg.train, cfg.snapshot
        return cls(
            train.max_epochs if epochs else 2**62,
            train.max_steps,
            train.eval_every_epochs,
            evaluates,
            snapshot.durable.every_steps,
            snapshot.durable.on_done,
            snapshot.local.every_steps if fast_tier else 0,
        )


def run_finished(progress: Progress, plan: Plan) -> bool:
    """Every epoch (or train.max_steps) is trained: what is left is the end's evaluation and snapshot."""
    return progress.epoch >= plan.max_epochs or (plan.max_steps is not None and progress.global_step >= plan.max_steps)


def decide(progress: Progress, plan: Plan, requests: Requests = Requests()) -> State:
    """What follows RESTORE, TRAIN, EVALUATE, SNAPSHOT or ROLLBACK, given where training is and what the ranks asked for."""
    # ``last_snapshot_step`` is the step of the last snapshot *taken*, committed or not: a
    # failed one is retried at the next interval, never in a loop at the same step.
    snapshot_taken = progress.last_snapshot_step == progress.global_step
    if requests.anomaly:
        # Before anything else: no snapshot, evaluation or stop may start from a step some rank found anomalous.
        return State.ROLLBACK
    if requests.preempt:
        # Stop with nothing lost: a snapshot of this very step first (none is needed at step 0).
        return State.PREEMPTED if snapshot_taken or progress.global_step == 0 else State.SNAPSHOT
    finished = run_finished(progress, plan)
    at_epoch_end = progress.epoch_offset == 0 and progress.global_step > 0
    eval_due = (
        plan.has_val_data
        and progress.last_evaluated_step != progress.global_step
        and (finished or (at_epoch_end and plan.eval_every_epochs > 0 and progress.epoch % plan.eval_every_epochs == 0))
    )
    if eval_due:
        return State.EVALUATE
    snapshot_due = not snapshot_taken and (
        (requests.snapshot and progress.global_step > 0)  # a fresh start at step 0 needs no snapshot
        or (
            plan.snapshot_every_steps > 0
            and progress.global_step % plan.snapshot_every_steps == 0
            and progress.global_step > 0
        )
        or (finished and plan.snapshot_on_done)
    )
    if snapshot_due:
        return State.SNAPSHOT
    local_due = (
        not finished
        and progress.global_step > 0
        and not snapshot_taken
        and progress.last_local_snapshot_step != progress.global_step
        and (
            requests.local_snapshot
            or (plan.local_every_steps > 0 and progress.global_step % plan.local_every_steps == 0)
        )
    )
    if local_due:
        return State.LOCAL_SNAPSHOT
    return State.DONE if finished else State.TRAIN
