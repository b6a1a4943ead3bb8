"""The worker's states, the table of allowed transitions, and the machine that enforces it.

Like torch elastic's ``WorkerState``, a worker is always in exactly one state; unlike the agent's
implicit ``if/elif``, every edge is data here, and an edge that is not in the table raises.
"""

from __future__ import annotations

import enum
import logging
from collections import defaultdict
from collections.abc import Callable

log = logging.getLogger("elastictrain")


class State(enum.Enum):
    """The states of a worker; ``Trainer.on(src, dst)`` hooks and observers see its transitions."""

    SETUP = "setup"  # process group, device, model/optimizer/data built
    RESTORE = "restore"  # newest valid snapshot loaded (or a fresh start chosen)
    TRAIN = "train"  # optimizer steps until something else is due
    EVALUATE = "evaluate"  # one pass over the validation data
    SNAPSHOT = "snapshot"  # the whole training state committed to storage
    LOCAL_SNAPSHOT = "local_snapshot"  # the whole training state copied to each node's fast tier
    ROLLBACK = "rollback"  # an anomaly: the newest snapshot restored in-process, to replay (anomalies.py)
    PREEMPTED = "preempted"  # stopped on request with a snapshot written; the next launch resumes
    DONE = "done"  # training finished; final snapshot written
    FAILED = "failed"  # an exception ended the worker


TERMINAL = frozenset({State.PREEMPTED, State.DONE, State.FAILED})

# Every non-terminal state may also go to FAILED; it is added below, not repeated on each line.
_EDGES: dict[State, frozenset[State]] = {
    State.SETUP: frozenset({State.RESTORE}),
    # RESTORE -> PREEMPTED: a signal before the first step, with the restored snapshot current.
    State.RESTORE: frozenset(
        {State.TRAIN, State.EVALUATE, State.SNAPSHOT, State.LOCAL_SNAPSHOT, State.DONE, State.PREEMPTED}
    ),
    State.TRAIN: frozenset(
        {State.EVALUATE, State.SNAPSHOT, State.LOCAL_SNAPSHOT, State.DONE, State.PREEMPTED, State.ROLLBACK}
    ),
    # ROLLBACK restores a snapshot as RESTORE does, then goes on as after it (or rolls back again).
    State.ROLLBACK: frozenset(
        {State.TRAIN, State.EVALUATE, State.SNAPSHOT, State.LOCAL_SNAPSHOT, State.DONE, State.PREEMPTED, State.ROLLBACK}
    ),
    State.EVALUATE: frozenset({State.TRAIN, State.SNAPSHOT, State.LOCAL_SNAPSHOT, State.DONE, State.PREEMPTED}),
    # PREEMPTED and DONE are entered after their snapshot is committed.
    State.SNAPSHOT: frozenset({State.TRAIN, State.EVALUATE, State.DONE, State.PREEMPTED}),
    # A fast-tier snapshot never ends a run: DONE and PREEMPTED take a durable one first.
    State.LOCAL_SNAPSHOT: frozenset({State.TRAIN, State.EVALUATE, State.SNAPSHOT, State.PREEMPTED}),
    State.PREEMPTED: frozenset(),
    State.DONE: frozenset(),
    State.FAILED: frozenset(),
}
ALLOWED: dict[State, frozenset[State]] = {
    state: targets if state in TERMINAL else targets | {State.FAILED} for state, targets in _EDGES.items()
}


class IllegalTransition(RuntimeError):
    """A transition that the table forbids: a bug in the loop, never a user error."""


Hook = Callable[[State, State, int], None]


class StateMachine:
    """Holds the current state; ``transition`` checks the table, logs and fires hooks."""

    def __init__(self, log_transitions: bool = True) -> None:
        self.state = State.SETUP
        self.log_transitions = log_transitions
        self._hooks: dict[tuple[State | None, State | None], list[Hook]] = defaultdict(list)

    def on(self, src: State | None = None, dst: State | None = None) -> Callable[[Hook], Hook]:
        """Register ``hook(src, dst, step)`` for an edge; ``None`` on either side matches any state."""

        def register(hook: Hook) -> Hook:
            self._hooks[(src, dst)].append(hook)
            return hook

        return register

    def transition(self, dst: State, step: int) -> None:
        src = self.state
        if dst not in ALLOWED[src]:
            raise IllegalTransition(f"illegal transition {src.name} -> {dst.name} at step {step}")
        self.state = dst
        if self.log_transitions:
            log.info("state %s -> %s at step %d", src.name, dst.name, step)
        for key in ((src, dst), (src, None), (None, dst), (None, None)):
            for hook in self._hooks.get(key, ()):
                hook(src, dst, step)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL
