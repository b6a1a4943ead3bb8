"""The end of a rank's part of the run, as the session's ``with`` block leaves: an error said in one line and FAILED
(a lost peer: the survivor copy first), a block left before the run was done reported, then the teardown in its
order (signals, snapshot writes, observers, the process group).
"""

from __future__ import annotations

from collections.abc import Callable

from elastictrain.core.config import Config
from elastictrain.core.errors import PeerLost
from elastictrain.core.events import Observers
from elastictrain.core.signals import Preempted, SignalledInSetup
from elastictrain.core.states import State, StateMachine
from elastictrain.dist import group as dist
from elastictrain.dist.failures import report_failure, report_left_early
from elastictrain.train.health import Health
from elastictrain.train.tiers import SnapshotTiers


class FailurePath:
    """Leave the session once: ``leave(exc)`` returns the exception to raise instead of ``exc`` (a PeerLost or a
    RepeatedCrash), or None."""

    def __init__(self, cfg: Config, machine: StateMachine, health: Health, events: Observers) -> None:
        self.cfg, self.machine, self.health, self.events = cfg, machine, health, events
        self.peer_lost = False

    def leave(
        self,
        exc: BaseException | None,
        *,
        rank_label: str,
        step: int,
        ctx: dist.DistContext | None,
        tiers: SnapshotTiers | None,
        survivor_copy: Callable[[], None] | None,
    ) -> BaseException | None:
        """``survivor_copy``: writes this rank's copy of the last step every rank finished (None before TRAIN)."""
        replacement = None
        try:
            if exc is not None and not isinstance(exc, Preempted) or isinstance(exc, SignalledInSetup):
                replacement = self._fail(exc, rank_label, step, ctx, survivor_copy)
            elif exc is None and not self.machine.finished:
                report_left_early(rank_label, step, tiers.last_committed if tiers is not None else None, ctx)
        finally:
            self.health.signals.uninstall()
            if tiers is not None:
                tiers.close()
            self.events.closed()
            if self.peer_lost:  # the launcher's SIGTERM, held for a snapshot a broken group cannot take, ends us now:
                self.health.signals.redeliver()  # before the teardown, which waits ~0.35 s on the dead peer's gloo pairs
            if ctx is not None:
                dist.teardown(ctx)
        return replacement

    def _fail(
        self,
        exc: BaseException,
        rank_label: str,
        step: int,
        ctx: dist.DistContext | None,
        survivor_copy: Callable[[], None] | None,
    ) -> BaseException | None:
        """Say in one line why this rank stopped (failures.py) and go to FAILED."""
        state = self.machine.state
        replacement = report_failure(exc, rank_label, state.name, step, ctx, self.cfg.preempt.requeue)
        if isinstance(replacement, PeerLost):
            self.peer_lost = True
            if survivor_copy is not None and state is State.TRAIN and self.health.anomalies.pending is None:
                survivor_copy()
        if not self.machine.finished:
            self.machine.transition(State.FAILED, step)
        return replacement
