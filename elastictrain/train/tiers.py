"""The two snapshot tiers as one object: the durable store, the node-local fast copies, their
timers, survivor copies, and the background writes they report, flush and close.

The durable tier (``snapshot.durable.url``) is written by rank 0 and is the run's record; the fast tier
(``snapshot.local.url``) keeps a full copy on each node, restored from first when it is the
newest. A durable snapshot is a fast one too, so that restarts read memory. Which step takes which
tier is ``decide``'s (train/trainer.py); this object only carries it out.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from torch import nn

from elastictrain.core.config import Config
from elastictrain.core.events import Committed, Observers, SnapshotReport
from elastictrain.dist.group import DistContext
from elastictrain.health.replicas import ReplicaCheck
from elastictrain.snapshot.cadence import COST_KEY, FastTierTimer
from elastictrain.snapshot.durable_tier import DurableTier
from elastictrain.snapshot.local_tier import LocalTier
from elastictrain.snapshot.restore import Restored
from elastictrain.snapshot.snapshotter import Snapshotter
from elastictrain.snapshot.survivor import SurvivorCopies
from elastictrain.train.registry import Registry
from elastictrain.train.runstate import RunState

log = logging.getLogger("elastictrain")


class SnapshotTiers:
    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        model: nn.Module,
        statefuls: dict[str, Any],
        state: RunState,
        events: Observers,
        *,
        train_samples: int | None,
        rank_statefuls: dict[str, Any],
        survivors_refused: str | None = None,
        replicated: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.ctx, self.state, self.events = cfg, ctx, state, events
        # Every snapshot, and the run's end, first checks that the ranks' replicas agree (replicas.py).
        self.replicas = ReplicaCheck(ctx, replicated or {}, cfg.dist.check_replicas)
        self.durable = DurableTier(cfg, ctx, model, statefuls, train_samples, rank_statefuls)
        self.local = (
            LocalTier(cfg, ctx, model, statefuls, train_samples, rank_statefuls) if cfg.local_snapshot_url else None
        )
        # Rank 0's clock for timed fast copies (snapshot.local.every_s); the vote carries it to every rank.
        timer = FastTierTimer(cfg.snapshot.local.every_s, prior_mtbf_s=cfg.snapshot.local.mtbf_prior_s)
        self.fast_timer: FastTierTimer | None = None
        if self.local is not None and ctx.is_main and timer.enabled:
            self.fast_timer = timer
            events.add(timer)
        self.survivors: SurvivorCopies | None = None
        if self.local is not None and cfg.snapshot.local.survivor_copies:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None  # torchrun's
            why_not = survivors_refused or SurvivorCopies.applies(self.local, model, ctx.world_size, local_world)
            if why_not is None:
                self.survivors = SurvivorCopies(
                    self.local,
                    ctx.world_size,
                    ctx.round_id,
                    state.progress,
                    state.history,
                    self.durable.rank_state_now,
                    local_world,
                )
            elif ctx.is_main:
                log.info("no survivor copies (snapshot.local.survivor_copies): %s", why_not)
        self._last_durable = time.monotonic()

    @property
    def all(self) -> list[Snapshotter]:
        return [s for s in (self.durable, self.local) if s is not None]

    @property
    def url(self) -> str:
        return self.durable.url

    @property
    def last_committed(self) -> Committed | None:
        return self.durable.last_committed

    def restore(self) -> Restored | None:
        """The newest valid snapshot either tier holds, on every rank (Snapshotter.restore says how)."""
        return self.durable.restore(self.local)

    def roll_back(self, keep: tuple[str, ...]) -> Restored | None:
        """ROLLBACK, on every rank: background writes finished, then the newest valid snapshot of either tier
        loaded into everything but ``keep`` (anomalies.py)."""
        for report in self.durable.flush():
            self._snapshotted(report)
        if self.local is not None and self.local.is_writer:
            for report in self.local.finish_writes():
                self._snapshotted(report)
        self.replicas.forget()  # the steps from the snapshot on are trained again
        return self.durable.roll_back(self.local, keep)

    def begin(self, started_unix: float) -> None:
        """After RESTORE: start the timers from the run's record; open the survivor slots (a fresh start cleared them)."""
        # snapshot.durable.every_s counts from the durable store's newest snapshot (the run's first start
        # while it has none), not from this attempt: a job failing more often still gets durable snapshots.
        durable = self.durable.last_committed
        since_unix = durable.unix if durable else self.state.run_log.attempts[0].get("started_unix", started_unix)
        self._last_durable = time.monotonic() - max(time.time() - since_unix, 0.0)
        if self.fast_timer is not None:
            self.fast_timer.begin(self.state.run_log.attempts)
        if self.survivors is not None:
            self.survivors.open()

    def durable_due(self) -> bool:
        """Rank 0's snapshot.durable.every_s timer."""
        every_s = self.cfg.snapshot.durable.every_s
        return self.ctx.is_main and every_s > 0 and time.monotonic() - self._last_durable >= every_s

    def local_due(self) -> bool:
        return self.fast_timer is not None and self.fast_timer.due()

    def write_failed(self) -> bool:
        return self.ctx.is_main and self.durable.write_failed

    def poll(self) -> None:
        """Report the background writes finished since the last vote."""
        for snapshots in self.all:
            if snapshots.asynchronous and snapshots.is_writer:
                for report in snapshots.poll():
                    self._snapshotted(report)

    def take_durable(self, meta: dict[str, Any], wall_s: float) -> None:
        """SNAPSHOT: a durable snapshot of this step, and the fast copy of the same step (restarts read memory)."""
        progress = self.state.progress
        self.replicas.check(progress.global_step, "the durable snapshot")
        progress.last_snapshot_step = progress.global_step
        if self.local is not None:
            progress.last_local_snapshot_step = progress.global_step
        self.state.run_log.current["wall_s"] = wall_s
        # The fast copy first: written while training waits, it would share the CPU and memory bandwidth with the
        # durable write starting in the background (benchmarks/state_size_curve.py: 1 GB and more).
        if self.local is not None:
            self._report(self.local.save(progress.global_step, meta))
        self._report(self.durable.save(progress.global_step, meta))
        # Timed snapshots count from this attempt, committed or not: a store that is down is
        # tried again one interval later, not at every step.
        self._last_durable = time.monotonic()

    def take_local(self, meta: dict[str, Any], wall_s: float) -> None:
        """LOCAL_SNAPSHOT: each node's fast copy of this step."""
        progress = self.state.progress
        assert self.local is not None  # local_due() is False without the tier
        self.replicas.check(progress.global_step, "the fast copy")
        progress.last_local_snapshot_step = progress.global_step
        self.state.run_log.current["wall_s"] = wall_s
        self._report(self.local.save(progress.global_step, meta))

    def mark(self, step: int | None, registry: Registry) -> None:
        """This rank's part of a survivor copy of ``step`` (default: the current one)."""
        if self.survivors is not None:
            self.survivors.mark(self.ctx.device, step=step)
            registry.optimizer_steps = 0  # counted from here: a copy of this step refuses half a step

    def write_survivor_copy(
        self, meta: dict[str, Any], rank: str, wall_s: float, registry: Registry, marked_ahead: bool
    ) -> None:
        """A peer died while training: the node's lowest survivor writes the last step every rank completed.

        A custom loop marks at each step's end (``marked_ahead`` False): a registered optimizer that has
        stepped since then holds half a step (a GAN between its D and G steps), so no copy is written."""
        if self.survivors is None:
            return
        if not marked_ahead and registry.optimizer_steps:
            log.info(
                "no survivor copy: an optimizer stepped after step %d ended, so its state is half a step on; "
                "the restart reads the newest fast copy",
                self.state.progress.global_step,
            )
            return

        def complete() -> None:  # what a snapshot of this step would have recorded
            self.state.progress.last_local_snapshot_step = self.state.progress.global_step
            self.state.run_log.current["wall_s"] = wall_s
            self.state.run_log.current["survivor_copy"] = 1  # its failure lost no work: cadence.py does not count it

        try:
            self.survivors.write(complete, meta)
        except Exception:  # the restart reads the newest timed copy instead; the peer's loss stays the error
            log.exception("rank %s: the survivor copy of step %d failed", rank, self.state.progress.global_step)

    def flush(self, done: bool, step: int) -> None:
        """Before DONE or PREEMPTED: a snapshot written in the background ends, and all agree on it, first."""
        for report in self.durable.flush():
            self._snapshotted(report)
        if done:  # the weights the run ends with, its summary's params_sha256: the same on every rank
            self.replicas.check(step, "the run's end")
        # The node's memory is given back when the run is done, or stops with its step in the durable store.
        last = self.durable.last_committed
        if self.local is not None and (done or (last is not None and last.step == step)):
            self.local.clear()

    def close(self) -> None:
        for closeable in (self.durable, self.local, self.survivors):
            if closeable is not None:
                closeable.close()

    def _report(self, report: SnapshotReport | None) -> None:
        if report is not None:  # None: not this node's writer, or written in the background
            self._snapshotted(report)

    def _snapshotted(self, report: SnapshotReport) -> None:
        """Tell the observers; the attempt's record keeps the fast copies' measured cost (a restart's timer starts
        from it, cadence.py)."""
        self.events.snapshotted(report)
        cost = self.fast_timer.cost_s() if self.fast_timer is not None else None
        if cost is not None:
            self.state.run_log.current[COST_KEY] = round(cost, 6)
