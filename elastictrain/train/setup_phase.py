"""SETUP: the launch environment read, logging, the process group, the run's reporters, a fresh start's batch
geometry and the metrics; then every RNG seeded from ``run.seed``, the same on every rank. What the loop then sets up
before RESTORE lands here too: the wrapped models and the training set (and from it the run's length).

``with Session(...)`` runs one ``SetupPhase``; what it sets is kept on it as it goes (``rank_label``, ``ctx``), so
that a failure part-way is said with this rank's name and still tears down a process group it started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from elastictrain.core.config import Config
from elastictrain.core.errors import ConfigError, UsageError
from elastictrain.core.events import Observers
from elastictrain.core.logs import setup_logging
from elastictrain.core.rng import seed_rng
from elastictrain.core.states import State, StateMachine
from elastictrain.data.geometry import BatchGeometry, fit_to_world, run_steps
from elastictrain.data.sampling import Shard
from elastictrain.data.train_data import TrainData
from elastictrain.dist import ddp, fsdp
from elastictrain.dist import group as dist
from elastictrain.dist.gradsync import wrap_model_for
from elastictrain.launcher import launch_env
from elastictrain.train.health import Health
from elastictrain.train.registry import Registry
from elastictrain.train.runstate import RunState
from elastictrain.train.summary import attach_reporters
from elastictrain.train.train_metrics import TrainMetrics


class SetupPhase:
    """Bring this process into the run once: ``run()`` sets ``ctx``, ``shard`` and ``metrics``; then ``wrap()`` puts
    each model on the process's device (DDP or FSDP) and records it for the registry checks."""

    def __init__(
        self, cfg: Config, state: RunState, machine: StateMachine, events: Observers, health: Health, registry: Registry
    ) -> None:
        self.cfg, self.state, self.machine, self.events, self.health = cfg, state, machine, events, health
        self.registry = registry
        self.rank_label = "?"  # known once the launch environment is read
        self.ctx: dist.DistContext | None = None
        self.shard: Shard | None = None  # a fresh start's geometry; RESTORE fits it to the snapshot's
        self.metrics: TrainMetrics | None = None
        self.grad_sync: Any = None  # set by wrap(model, loss_fn): the step runner's gradient sync
        self.data: TrainData | None = None  # the training set, once session.loader() has it
        machine.on()(events.transition)
        machine.on(src=State.SETUP)(lambda *edge: health.signals.hold())  # a signal is voted on from now on

    def run(self) -> None:
        cfg, launch = self.cfg, launch_env.detect_launch_env()
        self.rank_label = str(launch.rank)
        setup_logging(launch.rank, launch.restart_count, cfg.log)
        self.state.threads.start()
        self.ctx = ctx = dist.setup(cfg.dist)
        # log.jsonl once the process group is up: a run.dir it cannot write to is recorded for the restarts, which stop at once.
        setup_logging(launch.rank, launch.restart_count, cfg.log, run_dir=cfg.run_dir)
        self.machine.log_transitions = ctx.is_main
        if ctx.distributed and cfg.snapshot.durable.retry_for_s >= cfg.dist.collective_timeout_s:
            # The other ranks wait for rank 0's commit in one collective.
            raise ConfigError(
                f"snapshot.durable.retry_for_s={cfg.snapshot.durable.retry_for_s:g} must be below dist.collective_timeout_s="
                f"{cfg.dist.collective_timeout_s:g}; lower the first or raise the second"
            )
        lost_on_restart = launch_env.store_lost_on_restart(cfg.durable_snapshot_url, launch)
        if lost_on_restart:
            raise ConfigError(lost_on_restart)
        self.health.attach(ctx, self.events)
        attach_reporters(cfg, ctx, self.events, self.machine, self.state)
        planned = fit_to_world(cfg.train, ctx.world_size, BatchGeometry(), None)  # a fresh start's geometry
        self.shard = Shard(ctx.rank, ctx.world_size, cfg.train.batch_size, planned.grad_accum_steps)
        optimizers = self.registry.optimizers
        self.metrics = TrainMetrics(
            ctx,
            self.state,
            self.events,
            self.health.sync_timer,
            lr=lambda: optimizers()[0].param_groups[0]["lr"] if optimizers() else None,
        )
        # What the loop builds now (models, an EMA copy) starts the same on every rank and every launch;
        # RESTORE then gives each rank its own streams (seed + rank) or the snapshot's.
        seed_rng(cfg.run.seed)

    @property
    def started(self) -> dist.DistContext:
        """The process group's context; CallOrder lets no call that needs it through before SETUP made it."""
        assert self.ctx is not None, "a call needing the process group reached SETUP before the group was made"
        return self.ctx

    def wrap(self, model: nn.Module, loss_fn: Callable | None) -> nn.Module:
        """``session.wrap``: the model on the device, under DDP with several workers (with ``loss_fn``: the loss)."""
        before = dict(model.named_parameters())
        wrapped, sync = wrap_model_for(model, loss_fn, self.started, self.cfg, self.health.sync_timer)
        self.grad_sync = sync or self.grad_sync
        self.registry.wrapped.append(ddp.state_module(wrapped))
        self.registry.replaced.update(fsdp.replaced_parameters(before, model))  # FSDP's sharded parameters
        return wrapped

    def loader(self, dataset: Any, collate_fn: Callable | None, on_end_without_step: Callable[[], None]) -> TrainData:
        """``session.loader``: the run's one training set, this rank's share of it."""
        if self.data is not None:
            raise UsageError(
                "session.loader() was called twice: a run has one training set, whose position the "
                "snapshots keep; build one loader"
            )
        assert self.shard is not None  # made with the process group
        self.data = TrainData(
            dataset,
            collate_fn,
            self.cfg,
            self.started,
            self.state.progress,
            self.shard,
            on_end_without_step=on_end_without_step,
            skipped=self.state.anomalies.skipped_samples,
        )
        return self.data

    def run_steps(self, global_batch: int | None) -> int:
        """The run's optimizer steps at ``global_batch`` (``session.total_steps``)."""
        if self.data is None and self.cfg.train.max_steps is None:  # 0 would be a scheduler's ZeroDivisionError
            raise UsageError(
                "session.total_steps is known once session.loader() has the training set (or "
                "train.max_steps is set): call session.loader() first"
            )
        data = self.data
        return run_steps(
            self.cfg.train,
            None if data is None or data.stream else data.samples,
            self.started.world_size,
            global_batch,
            self.state.progress,
        )
