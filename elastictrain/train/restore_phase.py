"""RESTORE: the snapshot tiers built over what is registered, the newest valid snapshot loaded (or a fresh start),
the batch fitted to the world size, and the run's records begun.

``session.restore()`` checks the call and runs one ``RestorePhase``; the session then hands what it returns
(``Restored``) to the ``StepDriver`` (driver.py), which takes the run into TRAIN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from elastictrain.core.config import Config
from elastictrain.core.errors import ConfigError
from elastictrain.core.events import Observers, RunInfo
from elastictrain.core.idle_keys import idle_keys_line
from elastictrain.core.rng import seed_rng
from elastictrain.core.states import State, StateMachine
from elastictrain.data.geometry import apply_fit, fit_to_world, scheduler_steps
from elastictrain.data.sampling import Shard
from elastictrain.data.train_data import TrainData
from elastictrain.dist import group as dist
from elastictrain.observe.trackers.ids import share_run_id
from elastictrain.train.loop_keys import LoopKeys
from elastictrain.train.plan import Plan
from elastictrain.train.registry import Registry
from elastictrain.train.registry_checks import unregistered_state_named
from elastictrain.train.runstate import RunState
from elastictrain.train.tiers import SnapshotTiers
from elastictrain.train.train_metrics import TrainMetrics

log = logging.getLogger("elastictrain")


class Restored(NamedTuple):
    """What RESTORE leaves for TRAIN."""

    model: nn.Module  # the registered model (several: one ModuleDict)
    tiers: SnapshotTiers
    plan: Plan
    shard: Shard  # this rank's batch geometry after the elastic batch policy


class RestorePhase:
    """Run RESTORE once, for one session: ``run()`` returns what TRAIN needs; ``tiers`` is set as soon as it is built
    (so that the session's end closes it, should RESTORE fail after it)."""

    def __init__(
        self,
        cfg: Config,
        ctx: dist.DistContext,
        state: RunState,
        machine: StateMachine,
        events: Observers,
        registry: Registry,
        metrics: TrainMetrics,
        keys: LoopKeys,
    ) -> None:
        self.cfg, self.ctx, self.state, self.machine, self.events = cfg, ctx, state, machine, events
        self.registry, self.metrics, self.keys = registry, metrics, keys
        self.tiers: SnapshotTiers | None = None

    def run(
        self, data: TrainData | None, evaluates: bool, started_unix: float, run_steps: Callable[[int | None], int]
    ) -> Restored:
        """``run_steps(global_batch)``: the run's optimizer steps at that global batch (session.total_steps)."""
        cfg, ctx, state, registry = self.cfg, self.ctx, self.state, self.registry
        model = registry.model()
        if ctx.is_main:  # said once for the run: what a resume would silently lose
            for warning in [*unregistered_state_named(registry.objects), *self.keys.at_restore(), *idle_keys_line(cfg)]:
                log.warning("%s", warning)
        if data is None and cfg.train.max_steps is None:
            raise ConfigError("a session without session.loader() has no epochs to end it: set train.max_steps")
        survivors_refused = None
        if not registry.optimizers():
            survivors_refused = "no optimizer is registered, so a copy cannot tell a step half done"
        self.tiers = tiers = SnapshotTiers(
            cfg,
            ctx,
            model,
            {**registry.statefuls(), **state.statefuls()},
            state,
            self.events,
            train_samples=data.samples if data else None,
            rank_statefuls={**(data.rank_statefuls if data else {}), "train_sums": self.metrics.sums},
            survivors_refused=survivors_refused,
            replicated=registry.objects,
        )
        plan = Plan.of(cfg, epochs=data is not None, evaluates=evaluates, fast_tier=tiers.local is not None)
        self.events.started(RunInfo.of(ctx, cfg.run_dir, run_steps(state.batch_geometry.global_batch)))
        self.machine.transition(State.RESTORE, state.progress.global_step)
        restored = tiers.restore()
        if restored is None:
            seed_rng(cfg.run.seed + ctx.rank)
            log.info("no snapshot at %s: starting fresh (world size %d)", tiers.url, ctx.world_size)
        # The batch policy on a world-size change (train.on_world_size_change) decides the accumulation.
        saved_world_size = restored.saved_world_size if restored is not None else None
        fit = fit_to_world(cfg.train, ctx.world_size, state.batch_geometry, saved_world_size)
        registry.build_schedulers(scheduler_steps(cfg.train, run_steps(fit.global_batch)), tiers.durable.statefuls)
        shard = apply_fit(fit, state.batch_geometry, ctx.rank, ctx.world_size, cfg.train, registry.with_schedulers())
        if data is not None:
            data.shard = shard
        step = state.progress.global_step
        state.run_log.begin(
            restart_count=ctx.env.restart_count,
            world_size=ctx.world_size,
            start_step=step,
            launcher=ctx.env.launcher,
            started_unix=started_unix,
            restored=restored is not None,
        )
        self.events.restored(step, restored.duration_s if restored else 0.0, restored is not None)
        if cfg.track.mlflow_uri:  # rank 0's tracker run, in every rank's copies (a fast copy from any node)
            share_run_id(state.tracking, ctx, at_start=True)
        if ctx.is_main:
            log.info("%s", state.threads.report())
        tiers.begin(started_unix)
        self.metrics.begin()
        return Restored(model, tiers, plan, shard)


__all__ = ["RestorePhase", "Restored"]
