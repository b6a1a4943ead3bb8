"""The worker loop: one state machine, one snapshot, exact resume.

``Trainer.fit`` runs SETUP -> RESTORE -> (TRAIN | EVALUATE | SNAPSHOT)* -> DONE, or PREEMPTED
when a signal asks the job to stop. Each state is one method that does its work and returns the
next state; ``decide`` (pure, table-tested) says what comes after training, evaluating or
snapshotting, from the progress counters and the requests all ranks agreed on, so every rank
takes the same path and a resumed worker takes the path an unbroken one would.

The pieces the loop calls are small objects of their own: ``Snapshotter`` (save and restore),
``StepVote`` (agreement on requests), ``PreemptionSignals`` and the ``Observers`` that metrics,
goodput and plots attach to.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset

from . import dist, failpoints
from .cadence import FastTierTimer
from .config import Config, load_config
from .data import (
    EvalBatchSampler,
    Shard,
    ShardedBatchSampler,
    batch_size_of,
    check_stream,
    is_stream,
    make_loader,
    make_stream_loader,
    steps_in_epoch,
    to_device,
)
from .errors import ConfigError, ElastictrainError, PeerLost, RepeatedFatalError
from .events import Observer, Observers, RunInfo, SnapshotReport, TrainInterval
from .fatal import claim_line
from .geometry import BatchGeometry, apply_fit, fit_to_world, planned_steps
from .goodput import Goodput
from .gradsync import make_gradient_sync
from .logs import ProgressReport, setup_logging
from .reduce import WeightedSums, reduce_objects
from .sample_seeds import warn_own_generators
from .signals import PREEMPTED_EXIT_CODE, Preempted, PreemptionSignals, SignalledInSetup, requeue_slurm_job
from .snapshot import History, Progress, RunLog, params_sha256, seed_rng
from .snapshotter import Snapshotter
from .states import State, StateMachine
from .stragglers import GradientSyncTimer, StragglerReport, StragglerSettings
from .survivor import SurvivorCopies
from .threads import ThreadPin
from .task import PendingScheduler, Task, load_task, split_loss
from .vote import NOTHING, Requests, StepVote
from .watchdog import Watchdog, WatchdogSettings

log = logging.getLogger("elastictrain")


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


def decide(progress: Progress, plan: Plan, requests: Requests = Requests()) -> State:
    """What follows RESTORE, TRAIN, EVALUATE or SNAPSHOT, given where training is and what the ranks asked for."""
    # ``last_snapshot_step`` is the step of the last snapshot *taken*, committed or not: a
    # failed one is retried at the next interval, never in a loop at the same step.
    snapshot_taken = progress.last_snapshot_step == progress.global_step
    if requests.preempt:
        # Stop with nothing lost: a snapshot of this very step first (none is needed at step 0).
        return State.PREEMPTED if snapshot_taken or progress.global_step == 0 else State.SNAPSHOT
    finished = progress.epoch >= plan.max_epochs or (
        plan.max_steps is not None and progress.global_step >= plan.max_steps
    )
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
        or (plan.snapshot_every_steps > 0 and progress.global_step % plan.snapshot_every_steps == 0 and progress.global_step > 0)
        or (finished and plan.snapshot_on_done)
    )
    if snapshot_due:
        return State.SNAPSHOT
    local_due = (
        not finished and progress.global_step > 0 and not snapshot_taken
        and progress.last_local_snapshot_step != progress.global_step
        and (requests.local_snapshot or (plan.local_every_steps > 0 and progress.global_step % plan.local_every_steps == 0))
    )
    if local_due:
        return State.LOCAL_SNAPSHOT
    return State.DONE if finished else State.TRAIN


@dataclass
class RunSummary:
    state: str
    global_step: int
    epoch: int
    world_size: int
    restart_count: int  # the launcher's restarts of this attempt (torchrun/SLURM)
    train_loss: float | None
    val_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    params_sha256: str = ""
    wall_s: float = 0.0  # this attempt
    attempts: int = 1  # launches and restarts of the whole run, relaunches included
    run_wall_s: float = 0.0  # every attempt's time up to its last snapshot, plus this attempt

    def line(self) -> str:
        values = {"train_loss": self.train_loss, "val_loss": self.val_loss, **self.val_metrics}
        shown = " ".join(f"{k}={v:.4f}" for k, v in values.items() if v is not None)
        return (
            f"run summary: state={self.state} step={self.global_step} epoch={self.epoch} "
            f"world_size={self.world_size} restart={self.restart_count} attempts={self.attempts} {shown} "
            f"wall_s={self.wall_s:.1f} run_wall_s={self.run_wall_s:.1f} params_sha256={self.params_sha256}"
        )


class Trainer:
    """Hand it a model, optimizer, datasets and a loss function; ``fit()`` trains and survives restarts.

    Launch the script with ``torchrun``, ``srun`` or plain ``python``: the environment decides
    the rest (``dist.distributed`` overrides). ``config`` is a Config, a dict, a YAML path or
    None (the defaults); ``overrides`` are ``key.sub=value`` strings applied on top.
    ``lr_scheduler`` is a scheduler, or a factory ``(optimizer, total_steps) -> scheduler`` that
    is called once the world size is known, with the number of ``scheduler.step()`` calls the
    run will make (``total_steps``). ``observers`` receive the run's events (``elastictrain.events``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Dataset,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        *,
        val_data: Dataset | None = None,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
        collate_fn: Callable | None = None,
        config: Config | dict | str | None = None,
        overrides: list[str] = (),
        observers: list[Observer] = (),
    ) -> None:
        self.cfg = load_config(config, list(overrides))
        self.task = Task(model, optimizer, train_data, loss_fn, val_data, lr_scheduler, grad_scaler, collate_fn)
        self.progress = Progress()
        self.history = History()
        self.run_log = RunLog()
        self.batch_geometry = BatchGeometry()
        self.threads = ThreadPin(self.cfg.train.intra_op_threads)  # bits: the run's thread count at every start
        self.goodput = Goodput()  # on every rank: its counters travel in the snapshot
        self.machine = StateMachine()
        self.events = Observers([self.goodput, *observers])
        self.signals = PreemptionSignals(self.cfg.preempt.signals)
        self.summary: RunSummary | None = None
        self.machine.on()(self.events.transition)
        self.machine.on(dst=State.DONE)(self._summarize)
        self.machine.on(dst=State.PREEMPTED)(self._preempted)
        self.machine.on(src=State.SETUP)(lambda src, dst, step: self.signals.hold())  # from now on a signal is voted on
        self._actions: dict[State, Callable[[], State]] = {
            State.SETUP: self._setup,
            State.RESTORE: self._restore,
            State.TRAIN: self._train,
            State.EVALUATE: self._evaluate,
            State.SNAPSHOT: self._snapshot,
            State.LOCAL_SNAPSHOT: self._local_snapshot,
        }

    @classmethod
    def from_task(cls, task: Task, config: Config | dict | str | None = None, overrides: list[str] = (),
                  observers: list[Observer] = ()) -> "Trainer":
        return cls(
            task.model, task.optimizer, task.train_data, task.loss_fn,
            val_data=task.val_data, lr_scheduler=task.lr_scheduler, grad_scaler=task.grad_scaler,
            collate_fn=task.collate_fn, config=config, overrides=overrides, observers=observers,
        )

    @classmethod
    def from_config(cls, config: Config | dict | str | None = None, overrides: list[str] = ()) -> "Trainer":
        """Build the task the config names, seeded with ``run.seed`` so every run starts from the same weights."""
        cfg = load_config(config, list(overrides))
        seed_rng(cfg.run.seed)
        return cls.from_task(load_task(cfg.task), cfg)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run: those done plus those left at its global batch (batch, world size,
        accumulation, epochs, max_steps). After a world-size change the global batch is the one the policy kept."""
        return self._total_steps(self.batch_geometry.global_batch)

    def _total_steps(self, global_batch: int | None) -> int:
        train = self.cfg.train
        if is_stream(self.task.train_data):
            return train.max_steps  # a stream has no length; check_stream makes max_steps required
        if global_batch is None:  # before the first restore: the plan of a fresh start at this world size
            world_size = self.ctx.world_size if getattr(self, "ctx", None) is not None else dist.planned_world_size(self.cfg.dist)
            global_batch = fit_to_world(train, world_size, BatchGeometry(), None).global_batch
        p = self.progress
        return planned_steps(len(self.task.train_data), global_batch, train.max_epochs, train.max_steps,
                             p.global_step, p.epoch, p.epoch_offset)

    @property
    def scheduler_steps(self) -> int:
        """How often ``lr_scheduler.step()`` is called in the run: per step, or per epoch (``train.lr_scheduler_interval``)."""
        return self._scheduler_steps(self.batch_geometry.global_batch)

    def _scheduler_steps(self, global_batch: int | None) -> int:
        return self._total_steps(global_batch) if self.cfg.train.lr_scheduler_interval == "step" else self.cfg.train.max_epochs

    def on(self, src: State | None = None, dst: State | None = None) -> Callable:
        """Decorator: run ``hook(src, dst, step)`` on a transition (None matches any state)."""
        return self.machine.on(src, dst)

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        """Train to the end; raises ``Preempted`` (a SystemExit with code 143) after a preemption snapshot."""
        self._started = time.monotonic()
        self._started_unix = time.time()
        self.ctx: dist.DistContext | None = None
        self.snapshots: Snapshotter | None = None
        self.local_snapshots: Snapshotter | None = None
        self.fast_timer: FastTierTimer | None = None
        self.survivors: SurvivorCopies | None = None
        self._rank_label = "?"  # known once SETUP has read the launch environment
        self._peer_lost = False
        self.signals.install(setting_up=True)  # until SETUP is left, a signal ends this rank at once: nothing to save yet
        try:
            while not self.machine.finished:
                next_state = self._actions[self.machine.state]()
                if next_state in (State.DONE, State.PREEMPTED):
                    self._flush_snapshots(next_state)  # a snapshot written in the background ends, and all agree on it, first
                self.machine.transition(next_state, self.progress.global_step)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self.signals.uninstall()
            for snapshots in (self.snapshots, self.local_snapshots, self.survivors):
                if snapshots is not None:
                    snapshots.close()
            self.events.closed()
            if self.ctx is not None:
                dist.teardown(self.ctx)
            if self._peer_lost:  # the launcher's SIGTERM, held for a snapshot a broken group cannot take, ends us now
                self.signals.redeliver()
        if self.machine.state is State.PREEMPTED:
            raise Preempted(self.signals.requested or "signal", self.progress.global_step)
        return self.summary

    def _fail(self, exc: BaseException) -> None:
        """Say in one line why this rank stopped (a traceback only for bugs), go to FAILED, re-raise."""
        where = (self._rank_label, self.machine.state.name, self.progress.global_step)
        replacement: BaseException | None = None
        if isinstance(exc, SignalledInSetup):  # no traceback: the launcher (or the user) asked it to stop
            log.error("%s", exc.line(self._rank_label))
            if self.cfg.preempt.requeue and self._rank_label == "0":
                requeue_slurm_job()
        elif isinstance(exc, RepeatedFatalError):
            if claim_line(exc):  # under torchrun: said once on this node (fatal.py)
                log.error("rank %s: %s", self._rank_label, exc)
        elif isinstance(exc, ElastictrainError):
            if claim_line(exc):
                log.error("rank %s stopped in state %s at step %d: %s", *where, exc)
            if not exc.retryable:
                dist.record_fatal_error(self.ctx, exc)
        elif _is_peer_loss(exc):
            reason = " ".join(str(exc).split())[:160]
            replacement = PeerLost(
                f"rank {self._rank_label} lost a peer in state {where[1]} at step {where[2]} ({reason}); "
                "the launcher restarts the group from the newest snapshot"
            )
            log.error("%s", replacement)
            self._peer_lost = True
            if self.survivors is not None and self.machine.state is State.TRAIN:
                self._write_survivor_copy()
        else:
            log.exception("rank %s failed in state %s at step %d", *where)
        if not self.machine.finished:
            self.machine.transition(State.FAILED, self.progress.global_step)
        if replacement is not None:
            raise replacement from None
        raise exc

    # -- states -----------------------------------------------------------------------------

    def _setup(self) -> State:
        launch = dist.detect_launch_env()
        self._rank_label = str(launch.rank)
        setup_logging(launch.rank, launch.restart_count, self.cfg.log)
        self.threads.start()
        self.ctx = dist.setup(self.cfg.dist)
        # log.jsonl once the process group is up: a run.dir it cannot write to is recorded for the restarts, which stop at once.
        setup_logging(launch.rank, launch.restart_count, self.cfg.log, run_dir=self.cfg.run_dir)
        self.machine.log_transitions = self.ctx.is_main
        self._attach_observers()
        train = self.cfg.train
        planned = fit_to_world(train, self.ctx.world_size, BatchGeometry(), None)  # a fresh start's geometry
        self.shard = Shard(self.ctx.rank, self.ctx.world_size, train.batch_size, planned.grad_accum_steps)
        self.stream = is_stream(self.task.train_data)
        if not self.stream and self.ctx.is_main:
            warn_own_generators(self.task.train_data)
        if self.stream:
            check_stream(self.task.train_data, self.cfg.data.num_workers, train.max_steps)
            if train.virtual_shards:
                raise ConfigError(
                    f"train.virtual_shards needs a map-style Dataset: a stream ({type(self.task.train_data).__name__}) is "
                    "read in per-rank shares that cannot be cut into the same virtual shards at another world size; "
                    "set train.virtual_shards=0"
                )
        elif steps_in_epoch(len(self.task.train_data), self.shard) == 0:
            raise ConfigError(
                f"the training set has {len(self.task.train_data)} samples, fewer than one optimizer step takes "
                f"({self.shard.samples_per_step} = train.batch_size x world size x train.grad_accum_steps); lower train.batch_size"
            )
        if self.ctx.distributed and self.cfg.snapshot.durable.retry_for_s >= self.cfg.dist.collective_timeout_s:
            # The other ranks wait for rank 0's commit in one collective.
            raise ConfigError(
                f"snapshot.durable.retry_for_s={self.cfg.snapshot.durable.retry_for_s:g} must be below dist.collective_timeout_s="
                f"{self.cfg.dist.collective_timeout_s:g}; lower the first or raise the second"
            )
        self.sync_timer = GradientSyncTimer()  # each rank's wait in the gradient all-reduce: stragglers
        self.model, self.grad_sync = make_gradient_sync(self.task.model, self.task.loss_fn, self.ctx, self.cfg, self.sync_timer)
        if _is_scheduler_factory(self.task.lr_scheduler):
            # Called in RESTORE, once the snapshot has said which global batch the run goes on with.
            self.task.lr_scheduler = PendingScheduler(self.task.lr_scheduler)
        self.scaler = self.task.grad_scaler
        if self.scaler is None and train.autocast_dtype == "float16":
            self.scaler = torch.amp.GradScaler(self.ctx.device.type)
        self.snapshots = Snapshotter(self.cfg, self.ctx, dist.unwrap(self.model), {
            "optimizer": self.task.optimizer, "lr_scheduler": self.task.lr_scheduler, "grad_scaler": self.scaler,
            "progress": self.progress, "history": self.history, "run_log": self.run_log, "goodput": self.goodput,
            "batch_geometry": self.batch_geometry, "threads": self.threads,
        }, train_samples=None if self.stream else len(self.task.train_data),
            rank_statefuls={"train_data": self.task.train_data} if self.stream else {})
        # The fast tier: a full copy on each node, restored from first when it is the newest.
        self.local_snapshots = Snapshotter(
            self.cfg, self.ctx, self.snapshots.model, self.snapshots.statefuls, self.snapshots.train_samples,
            self.snapshots.rank_statefuls, tier="local") if self.cfg.local_snapshot_url else None
        self.plan = Plan(
            train.max_epochs, train.max_steps, train.eval_every_epochs, self.task.val_data is not None,
            self.cfg.snapshot.durable.every_steps, self.cfg.snapshot.durable.on_done,
            self.cfg.snapshot.local.every_steps if self.local_snapshots else 0,
        )
        # Rank 0's clock for timed fast copies (snapshot.local.every_s); the vote carries it to every rank.
        timer = FastTierTimer(self.cfg.snapshot.local.every_s, prior_mtbf_s=self.cfg.snapshot.local.mtbf_prior_s)
        if self.local_snapshots is not None and self.ctx.is_main and timer.enabled:
            self.fast_timer = timer
            self.events.add(timer)
        self.vote = StepVote(self.ctx, self.cfg.preempt.vote_every_s)
        self._train_sums = WeightedSums(self.ctx.device)
        if self.local_snapshots is not None and self.cfg.snapshot.local.survivor_copies:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None  # torchrun's
            why_not = SurvivorCopies.applies(self.local_snapshots, self.snapshots.model, self.ctx.world_size, local_world)
            if why_not is None:
                self.survivors = SurvivorCopies(self.local_snapshots, self.ctx.world_size, self.ctx.round_id, self.progress,
                                                self.history, self.snapshots.rank_state, self._train_sums.pending)
            elif self.ctx.is_main:
                log.info("no survivor copies (snapshot.local.survivor_copies): %s", why_not)
        self._batches: Iterator | None = None
        self._steps_left = 0
        self._last_snapshot_time = time.monotonic()
        self._preempt_announced = False
        self.events.started(RunInfo(
            rank=self.ctx.rank, local_rank=self.ctx.env.local_rank, world_size=self.ctx.world_size,
            node_rank=self.ctx.env.node_rank, restart_count=self.ctx.env.restart_count, launcher=self.ctx.env.launcher,
            run_dir=self.cfg.run_dir, total_steps=self.total_steps, store=self.ctx.run_store, round_id=self.ctx.round_id,
        ))
        return State.RESTORE

    def _restore(self) -> State:
        restored = self.snapshots.restore(self.local_snapshots)
        if restored is None:
            seed_rng(self.cfg.run.seed + self.ctx.rank)
            log.info("no snapshot at %s: starting fresh (world size %d)", self.snapshots.url, self.ctx.world_size)
        # The batch policy on a world-size change (train.on_world_size_change) decides the accumulation.
        fit = fit_to_world(self.cfg.train, self.ctx.world_size, self.batch_geometry, restored and restored.saved_world_size)
        if isinstance(self.task.lr_scheduler, PendingScheduler):
            scheduler = self.task.lr_scheduler.build(self.task.optimizer, self._scheduler_steps(fit.global_batch))
            self.task.lr_scheduler = self.snapshots.statefuls["lr_scheduler"] = scheduler
        self.shard = apply_fit(fit, self.batch_geometry, self.ctx.rank, self.ctx.world_size, self.cfg.train,
                               self.task.optimizer, self.task.lr_scheduler)
        self.run_log.begin(
            restart_count=self.ctx.env.restart_count, world_size=self.ctx.world_size,
            start_step=self.progress.global_step, launcher=self.ctx.env.launcher, started_unix=self._started_unix,
            restored=restored is not None,
        )
        self.events.restored(self.progress.global_step, restored.duration_s if restored else 0.0, restored is not None)
        if self.ctx.is_main:
            log.info("%s", self.threads.report())
        # snapshot.durable.every_s counts from the durable store's newest snapshot (the run's first start
        # while it has none), not from this attempt: a job failing more often still gets durable snapshots.
        durable = self.snapshots.last_committed
        since_unix = durable[1] if durable else self.run_log.attempts[0].get("started_unix", self._started_unix)
        self._last_snapshot_time = time.monotonic() - max(time.time() - since_unix, 0.0)
        if self.fast_timer is not None:
            self.fast_timer.begin(self.run_log.attempts)
        self._interval = _Interval(self.progress.global_step, time.monotonic())
        if self.survivors is not None:  # after RESTORE: a fresh start clears the fast tier, slots included
            self.survivors.open()
        return self._next_state(self.vote.settle(self._local_requests()))

    def _next_state(self, requests: Requests) -> State:
        if requests.preempt:  # recorded before the preemption snapshot: the next attempt reads this one as no failure
            self.run_log.current["preempted"] = 1
        return decide(self.progress, self.plan, requests)

    def _train(self) -> State:
        self.model.train()
        # This rank's part of a copy of this step, should a peer die before the next one: written
        # on entry, in every step once its gradients are in (``_train_step``), and again once a
        # reduce has moved the metric sums into the history (``_reduce_train_metrics``).
        survivors = self.survivors
        if survivors is not None:
            survivors.mark(self.ctx.device)
        while True:
            if self._batches is None:
                self._open_epoch()
            # After a restore into a larger world the rest of an epoch can be under one step.
            if self._steps_left > 0:
                step_started = time.perf_counter()
                batches = self._next_batches()
                if batches is None:  # a stream's epoch ended on some rank
                    self._steps_left = 0
                else:
                    self._train_step(batches)
                    self._interval.step_time_s += time.perf_counter() - step_started
                    self._steps_left -= 1
                    self.watchdog.beat(self.progress.global_step)
                    self.goodput.stepped(self.progress.global_step)
            epoch_ended = self._steps_left == 0
            if epoch_ended:
                self._end_epoch()
            if epoch_ended or self.progress.global_step % self.cfg.train.log_every_steps == 0:
                self._reduce_train_metrics()
            if self.signals.requested is not None and not self._preempt_announced:
                self._announce_signal()  # at the step it arrived in, though the vote may come later
            # The vote posted now is read at the next voting boundary: it overlaps the steps between.
            requests = self.vote.post(self._local_requests)
            if requests.snapshot_failed:
                self.snapshots.raise_write_failure()
            next_state = self._next_state(requests)
            if next_state is not State.TRAIN:
                if self._train_sums.count:
                    self._reduce_train_metrics()
                # Leave TRAIN with nothing in flight and everything every rank asked for.
                return self._next_state(requests | self.vote.settle(self._local_requests()))

    def _evaluate(self) -> State:
        model = dist.unwrap(self.model)  # no DDP here: shards may be uneven, so no per-forward collective
        model.eval()
        sampler = EvalBatchSampler(len(self.task.val_data), self.ctx.rank, self.ctx.world_size, self.cfg.data.val_batch_size)
        loader = make_loader(self.task.val_data, sampler, self.cfg.data.num_workers, self.cfg.run.seed, self.task.collate_fn,
                             seed_in_process=False)
        count, sums = 0, {}
        with torch.no_grad(), self._autocast():
            for batch in loader:
                batch = to_device(batch, self.ctx.device)
                samples = batch_size_of(batch)
                loss, metrics = split_loss(self.task.loss_fn(model, batch))
                for name, value in {"loss": loss, **metrics}.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * samples
                count += samples
        means = reduce_objects(count, sums, self.ctx)
        self.progress.last_evaluated_step = self.progress.global_step
        record = {f"val_{name}": value for name, value in means.items()}
        self.history.append(step=self.progress.global_step, epoch=self.progress.epoch, **record)
        log.info("evaluated at step %d (epoch %d): %s", self.progress.global_step, self.progress.epoch, _fmt(record))
        self.events.evaluated(self.progress.global_step, self.progress.epoch, record)
        self.model.train()
        return self._next_state(self.vote.settle(self._local_requests()))

    def _snapshot(self) -> State:
        self.progress.last_snapshot_step = self.progress.global_step
        if self.local_snapshots is not None:  # a durable snapshot is a fast one too: restarts read memory
            self.progress.last_local_snapshot_step = self.progress.global_step
        self.run_log.current["wall_s"] = time.monotonic() - self._started
        report = self.snapshots.save(self.progress.global_step, self._snapshot_meta())
        if self.local_snapshots is not None:
            self._local_report(self.local_snapshots.save(self.progress.global_step, self._snapshot_meta()))
        # Timed snapshots count from this attempt, committed or not: a store that is down is
        # tried again one interval later, not at every step.
        self._last_snapshot_time = time.monotonic()
        if report is not None:  # None: written in the background, reported when done
            self.events.snapshotted(report)
        return self._next_state(self.vote.settle(self._local_requests()))

    def _local_snapshot(self) -> State:
        self.progress.last_local_snapshot_step = self.progress.global_step
        self.run_log.current["wall_s"] = time.monotonic() - self._started
        self._local_report(self.local_snapshots.save(self.progress.global_step, self._snapshot_meta()))
        # No vote here: the ranks agreed on everything when they left TRAIN, nothing is in flight, and
        # a request raised during the copy is read at the next voting step (a collective saved per copy).
        return self._next_state(NOTHING)

    def _write_survivor_copy(self) -> None:
        """A peer died while training: the node's lowest survivor writes the last step every rank completed."""
        def complete(means: dict[str, float]) -> None:  # what a snapshot of this step would have recorded
            if means:
                self._record_train_means(means)
            self.progress.last_local_snapshot_step = self.progress.global_step
            self.run_log.current["wall_s"] = time.monotonic() - self._started
            self.run_log.current["survivor_copy"] = 1  # its failure lost no work: cadence.py does not count it

        try:
            self.survivors.write(complete, self._snapshot_meta())
        except Exception:  # the restart reads the newest timed copy instead; the peer's loss stays the error
            log.exception("rank %s: the survivor copy of step %d failed", self._rank_label, self.progress.global_step)

    def _local_report(self, report: SnapshotReport | None) -> None:
        if report is not None:  # None: not this node's writer, or written in the background
            self.events.snapshotted(report)

    def _snapshot_meta(self) -> dict[str, Any]:
        return {"epoch": self.progress.epoch, "epoch_offset": self.progress.epoch_offset, "world_size": self.ctx.world_size}

    def _attach_observers(self) -> None:
        """The watchdog on every rank; rank 0's progress report, straggler report and plots; the exporter."""
        self.watchdog = Watchdog(WatchdogSettings(**self.cfg.watchdog.model_dump()))  # inert at hang_timeout_s=0
        self.events.add(self.watchdog)
        if self.ctx.is_main:
            self.events.add(ProgressReport(self.cfg.log))
            self.events.add(StragglerReport(StragglerSettings(**self.cfg.stragglers.model_dump())))
            if self.cfg.log.plots:
                self.machine.on(dst=State.DONE)(self._plot)
        metrics = self.cfg.metrics
        if metrics.port > 0 and (self.ctx.is_main or (metrics.per_node and self.ctx.env.local_rank == 0)):
            from .metrics import PrometheusObserver  # binds the port now: a port in use fails before training

            self.events.add(PrometheusObserver(metrics, goodput=self.goodput, run_name=self.cfg.run.name))

    def _plot(self, src: State, dst: State, step: int) -> None:
        from .plots import write_plots

        out_dir = f"{self.cfg.run_dir}/plots"
        try:
            paths = write_plots(self.history.records, self.run_log.attempts, out_dir, run_name=self.cfg.run.name)
        except ElastictrainError as exc:  # matplotlib missing: the run itself is fine
            log.info("no plots: %s", exc)
            return
        log.info("plots of %d metric(s) in %s", len(paths), out_dir)

    # -- requests every rank agrees on -----------------------------------------------------

    def _local_requests(self) -> Requests:
        if self.signals.requested is not None and not self._preempt_announced:
            self._announce_signal()
        every_s = self.cfg.snapshot.durable.every_s
        timer_fired = self.ctx.is_main and every_s > 0 and time.monotonic() - self._last_snapshot_time >= every_s
        for snapshots in (self.snapshots, self.local_snapshots):
            if snapshots is not None and snapshots.asynchronous and snapshots.is_writer:
                for report in snapshots.poll():  # background writes finished since the last vote
                    self.events.snapshotted(report)
        return Requests(preempt=self.signals.requested is not None, snapshot=timer_fired,
                        snapshot_failed=self.ctx.is_main and self.snapshots.write_failed,
                        local_snapshot=self.fast_timer is not None and self.fast_timer.due())

    def _flush_snapshots(self, ending: State) -> None:
        for report in self.snapshots.flush():
            self.events.snapshotted(report)
        # The node's memory is given back when the run is done, or stops with its step in the durable store.
        last = self.snapshots.last_committed
        if self.local_snapshots is not None and (
                ending is State.DONE or (last is not None and last[0] == self.progress.global_step)):
            self.local_snapshots.clear()

    def _announce_signal(self) -> None:
        self._preempt_announced = True
        log.warning("rank %d received %s at step %d: every rank stops at the next agreed step, snapshots it and exits %d",
                    self.ctx.rank, self.signals.requested, self.progress.global_step, PREEMPTED_EXIT_CODE)
        self.events.preempt_requested(self.signals.requested, self.progress.global_step)

    def _preempted(self, src: State, dst: State, step: int) -> None:
        self.run_log.current["preempted"] = 1
        if self.signals.repeats:
            log.warning("rank %d: %d more signal(s) arrived while stopping; the snapshot was not interrupted",
                        self.ctx.rank, self.signals.repeats)
        if not self.ctx.is_main:
            return
        last = self.snapshots.last_committed
        if last is not None and last[0] == step:
            log.warning("preempted at step %d: snapshot committed, exiting with code %d; the same command resumes "
                        "from step %d with nothing lost", step, PREEMPTED_EXIT_CODE, step)
        else:
            resume_step = last[0] if last is not None else 0
            log.error("preempted at step %d, but its snapshot could not be committed; the next launch resumes "
                      "from step %d (%d steps lost)", step, resume_step, step - resume_step)
        if self.cfg.preempt.requeue:
            requeue_slurm_job()

    # -- training steps -------------------------------------------------------------------

    def _open_epoch(self) -> None:
        if self.stream:
            loader = make_stream_loader(self.task.train_data, self.cfg.train.batch_size, self.progress.epoch,
                                        self.cfg.run.seed + self.progress.epoch, self.task.collate_fn)
            self._batches, self._steps_left = iter(loader), _UNTIL_EXHAUSTED
            return
        sampler = ShardedBatchSampler(
            len(self.task.train_data), self.shard, self.cfg.run.seed, self.progress.epoch,
            self.progress.epoch_offset, self.cfg.data.shuffle,
        )
        loader = make_loader(
            self.task.train_data, sampler, self.cfg.data.num_workers,
            self.cfg.run.seed + self.progress.epoch, self.task.collate_fn,
            seed_in_process=self.cfg.train.virtual_shards > 0,  # the same numbers whichever rank fetches a sample
        )
        self._batches = iter(loader)
        self._steps_left = sampler.steps

    def _end_epoch(self) -> None:
        self.progress.end_epoch()
        self._batches = None
        if self.task.lr_scheduler is not None and self.cfg.train.lr_scheduler_interval == "epoch":
            self.task.lr_scheduler.step()

    def _next_batches(self) -> list[Any] | None:
        """The micro-batches of the next step; None when a stream's epoch ended (on any rank: all agree)."""
        accum = self.shard.grad_accum_steps
        if not self.stream:
            return [next(self._batches) for _ in range(accum)]
        batches = list(itertools.islice(self._batches, accum))
        # A short or missing batch ends the epoch, as an incomplete step does for map-style data.
        ended = len(batches) < accum or any(batch_size_of(b) < self.cfg.train.batch_size for b in batches)
        if self.ctx.distributed:
            ended = dist.all_reduce_sum(torch.tensor([float(ended)], dtype=torch.float64), self.ctx).item() > 0
        return None if ended else batches

    def _train_step(self, batches: list[Any]) -> None:
        accum, sync = self.shard.grad_accum_steps, self.grad_sync
        optimizer, scaler = self.task.optimizer, self.scaler
        for micro, batch in enumerate(batches):
            batch = to_device(batch, self.ctx.device)
            with sync.micro_batch(micro, accum, self.progress.global_step):
                with self._autocast():
                    loss, metrics = split_loss(self.model(batch))  # loss_fn inside DDP's forward: see dist.LossForward
                scaled = sync.scale(loss, accum)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            self._train_sums.add(batch_size_of(batch), {"loss": loss, **metrics})
        sync.finish(accum)  # every rank holds the step's gradients
        if self.survivors is not None:
            # Its per-rank state is now what it will be after this step: a rank that dies in the optimizer
            # step, which its peers also finish, still leaves a slot naming the step they are at.
            self.survivors.mark(self.ctx.device, step=self.progress.global_step + 1)
        failpoints.hit("optimizer-step", self.progress.global_step + 1)  # tests: a rank killed here, its peers go on
        if self.cfg.train.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.task.lr_scheduler is not None and self.cfg.train.lr_scheduler_interval == "step":
            self.task.lr_scheduler.step()
        self.progress.advance(self.shard.samples_per_step)

    def _reduce_train_metrics(self) -> None:
        # Each rank's mean step time, and its wait in the gradient all-reduce, ride in slots of
        # their own in the metrics' all_reduce: rank 0 sees every rank's (stragglers) without a
        # collective of its own.
        interval, now = self._interval, time.monotonic()
        steps = self.progress.global_step - interval.start_step
        world = self.ctx.world_size
        slots = [0.0] * (2 * world)
        slots[self.ctx.rank] = interval.step_time_s / steps if steps else 0.0
        slots[world + self.ctx.rank] = self.sync_timer.take()
        means, slots = self._train_sums.reduce(self.ctx, slots)
        self._interval = _Interval(self.progress.global_step, now)
        record = self._record_train_means(means) if means else None
        if self.survivors is not None:  # the sums are now in the history (and a stream's epoch may have ended)
            self.survivors.mark(self.ctx.device)
        if record is None:
            return
        self.events.trained(TrainInterval(
            step=self.progress.global_step, epoch=self.progress.epoch, steps=steps,
            samples=steps * self.shard.samples_per_step, elapsed_s=now - interval.started, metrics=record,
            step_time_s_by_rank=slots[:world], sync_wait_s_by_rank=slots[world:],
        ))

    def _record_train_means(self, means: dict[str, float]) -> dict[str, float]:
        """The history record of the training metrics reduced at this step (a log interval, or a survivor copy's)."""
        record = {f"train_{name}": value for name, value in means.items()}
        record["lr"] = self.task.optimizer.param_groups[0]["lr"]
        self.history.append(step=self.progress.global_step, epoch=self.progress.epoch, **record)
        return record

    def _autocast(self) -> Any:
        dtype = self.cfg.train.autocast_dtype
        if dtype == "none":
            return nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=getattr(torch, dtype))

    def _summarize(self, src: State, dst: State, step: int) -> None:
        wall_s = time.monotonic() - self._started
        self.summary = RunSummary(
            state=dst.name,
            global_step=self.progress.global_step,
            epoch=self.progress.epoch,
            world_size=self.ctx.world_size,
            restart_count=self.ctx.env.restart_count,
            train_loss=self.history.last("train_loss"),
            val_loss=self.history.last("val_loss"),
            val_metrics={
                k: v for k, v in (self.history.records[-1] if self.history.records else {}).items()
                if k.startswith("val_") and k != "val_loss"
            },
            params_sha256=params_sha256(dist.unwrap(self.model)),
            wall_s=wall_s,
            attempts=len(self.run_log.attempts),
            run_wall_s=self.run_log.total("wall_s") - self.run_log.current["wall_s"] + wall_s,
        )
        log.info("%s", self.summary.line())


_UNTIL_EXHAUSTED = 2**62  # a stream's epoch has no step count: it ends when the stream does


@dataclass
class _Interval:
    """The log interval in progress: where it started and the time spent inside optimizer steps."""

    start_step: int
    started: float
    step_time_s: float = 0.0


def _is_scheduler_factory(candidate: Any) -> bool:
    """A callable that is not itself a scheduler (schedulers have ``state_dict`` and are not callable)."""
    return callable(candidate) and not hasattr(candidate, "state_dict")


def _is_peer_loss(exc: BaseException) -> bool:
    """A collective that failed because another rank went away (gloo/nccl errors, collective timeouts)."""
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "[/gloo/", "gloo/transport", "Timed out waiting")
    )


def _fmt(record: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in record.items())
