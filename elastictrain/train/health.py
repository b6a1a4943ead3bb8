"""Health: the preemption signals, the vote every rank agrees on, the watchdog, the stragglers and anomalies.

A signal is only recorded on the rank that got it; ``requests`` turns it, and the tiers' timers,
into this rank's ``Requests``; ``post`` (overlapped with the steps) and ``settle`` (synchronous,
at state boundaries) make them every rank's. The watchdog is beaten once per step; the straggler
report reads the step times that ride in the metrics' reduce.
"""

from __future__ import annotations

import logging

from elastictrain.core.config import Config
from elastictrain.core.events import Committed, Observers
from elastictrain.core.signals import PREEMPTED_EXIT_CODE, PreemptionSignals, requeue_slurm_job
from elastictrain.dist.group import DistContext
from elastictrain.dist.sync_timer import GradientSyncTimer
from elastictrain.dist.vote import Requests, StepVote
from elastictrain.health.anomalies import Anomalies
from elastictrain.health.hangs import WatchdogSettings
from elastictrain.health.watchdog import Watchdog
from elastictrain.observe.stragglers import StragglerReport, StragglerSettings
from elastictrain.train.runstate import RunState
from elastictrain.train.tiers import SnapshotTiers

log = logging.getLogger("elastictrain")


class Health:
    def __init__(self, cfg: Config, state: RunState) -> None:
        self.cfg = cfg
        self.anomalies = Anomalies(cfg.anomaly, state.anomalies, state.grad_norms)  # self-healing (anomalies.py)
        self.signals = PreemptionSignals(cfg.preempt.signals)
        self.sync_timer = GradientSyncTimer()  # each rank's wait in the gradient all-reduce: stragglers
        self.watchdog: Watchdog | None = None
        self.vote: StepVote | None = None
        self._announced = False

    def attach(self, ctx: DistContext, events: Observers) -> None:
        """After the process group is up: the watchdog on every rank, the straggler report on rank 0, the vote."""
        self.ctx = ctx
        self.events = events
        self.watchdog = Watchdog(WatchdogSettings(**self.cfg.watchdog.model_dump()))  # inert at hang_timeout_s=0
        events.add(self.watchdog)
        if ctx.is_main:
            events.add(StragglerReport(StragglerSettings(**self.cfg.stragglers.model_dump())))
        self.vote = StepVote(ctx, self.cfg.preempt.vote_every_s)
        self.anomalies.attach(ctx, events)

    def beat(self, step: int) -> None:
        assert self.watchdog is not None, "attach() first"
        self.watchdog.beat(step)

    def requests(self, tiers: SnapshotTiers, step: int) -> Requests:
        """This rank's requests now: a signal it received, rank 0's timers, a background write that failed, an
        anomaly waiting for its rollback."""
        self.announce(step)
        tiers.poll()
        return Requests(
            preempt=self.signals.requested is not None,
            snapshot=tiers.durable_due(),
            snapshot_failed=tiers.write_failed(),
            local_snapshot=tiers.local_due(),
            anomaly=self.anomalies.pending is not None,
        )

    def post(self, tiers: SnapshotTiers, step: int) -> Requests:
        """At a step boundary: what the ranks agreed at the previous vote; this rank's requests travel meanwhile."""
        assert self.vote is not None, "attach() first"
        return self.vote.post(lambda: self.requests(tiers, step), step)

    def settle(self, tiers: SnapshotTiers, step: int) -> Requests:
        """Leaving a state: nothing in flight, everything every rank asked for."""
        assert self.vote is not None, "attach() first"
        return self.vote.settle(self.requests(tiers, step), step)

    def announce(self, step: int) -> None:
        """Once, at the step a signal arrived in (the vote that acts on it may come later)."""
        if self.signals.requested is None or self._announced:
            return
        self._announced = True
        # An agent SIGKILLed leaves its workers orphans that nothing would restart: its exit signals them (signals.py).
        got = "'s torchrun agent exited, its signal" if self.signals.launcher_gone else " received"
        log.warning(
            "rank %d%s %s at step %d: every rank stops at the next agreed step, snapshots it and exits %d",
            self.ctx.rank,
            got,
            self.signals.requested,
            step,
            PREEMPTED_EXIT_CODE,
        )
        self.events.preempt_requested(self.signals.requested, step)

    def preempted(self, step: int, last_committed: Committed | None) -> None:
        """PREEMPTED: one line on rank 0 saying what the next launch resumes from; SLURM requeue if asked."""
        if self.signals.repeats:
            log.warning(
                "rank %d: %d more signal(s) arrived while stopping; the snapshot was not interrupted",
                self.ctx.rank,
                self.signals.repeats,
            )
        if not self.ctx.is_main:
            return
        if last_committed is not None and last_committed.step == step:
            log.warning(
                "preempted at step %d: snapshot committed, exiting with code %d; the same command resumes "
                "from step %d with nothing lost",
                step,
                PREEMPTED_EXIT_CODE,
                step,
            )
        else:
            resume_step = last_committed.step if last_committed is not None else 0
            log.error(
                "preempted at step %d, but its snapshot could not be committed; the next launch resumes "
                "from step %d (%d steps lost)",
                step,
                resume_step,
                step - resume_step,
            )
        if self.cfg.preempt.requeue:
            requeue_slurm_job()
