"""The building blocks for your own training loop: one ``Session`` per process.

    with elastictrain.Session(config) as session:      # SETUP: device, process group, logging, health
        model = session.wrap(model)                     # DDP on the session's device
        session.register(model=model, optimizer=opt)    # everything that is state (anything Stateful)
        loader = session.loader(train_set)              # sharded; resumes mid-epoch
        session.restore()                               # RESTORE: the newest valid snapshot, if any
        for epoch in session.epochs():
            for batch in loader:
                ...                                     # any step: several models, optimizers, GANs
                session.step(loss=loss)                 # TRAIN -> the agreed next state

``step`` is the one call per optimizer step. It advances the data position, beats the watchdog,
counts goodput, reduces the logged metrics across ranks every ``train.log_every_steps``, and
takes the vote every rank agrees on (signals, timers); then ``decide`` (pure, in states.py) says
what follows, and the session does it before returning: a durable or fast snapshot, an
evaluation, DONE, or PREEMPTED (a snapshot of this very step, then ``Preempted``: exit 143). The
``with`` block ends the process's part of the run whatever happens: background writes finish or
are abandoned safely, the process group is torn down, and an error is said in one line on the rank
that had it (a traceback only for bugs). ``Trainer`` (train/trainer.py) is a short client of this class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from elastictrain.core import failpoints
from elastictrain.core.config import Config, load_config
from elastictrain.core.errors import ConfigError, PeerLost, UsageError
from elastictrain.core.events import Observer, Observers, RunInfo
from elastictrain.core.idle_keys import idle_keys_line
from elastictrain.core.logs import setup_logging
from elastictrain.core.rng import seed_rng
from elastictrain.core.signals import Preempted, SignalledInSetup
from elastictrain.core.states import State, StateMachine
from elastictrain.data.geometry import BatchGeometry, apply_fit, fit_to_world, run_steps, scheduler_steps
from elastictrain.data.sampling import Shard
from elastictrain.data.train_data import Loader, TrainData, wrong_micro_batches
from elastictrain.dist import ddp, fsdp
from elastictrain.dist import group as dist
from elastictrain.dist.failures import report_failure, report_left_early, used_after_the_block
from elastictrain.dist.gradsync import wrap_model_for
from elastictrain.dist.vote import NOTHING, Requests
from elastictrain.health.anomalies import clipping_norm, grad_norm
from elastictrain.launcher import launch_env
from elastictrain.observe.trackers.ids import share_run_id
from elastictrain.train.health import Health
from elastictrain.train.loop_keys import LoopKeys, validation_loader
from elastictrain.train.plan import Plan, decide, run_finished
from elastictrain.train.registry import Registry
from elastictrain.train.registry_checks import unregistered_state_named
from elastictrain.train.runstate import ROLLBACK_KEEPS, RunState
from elastictrain.train.step_runner import autocast
from elastictrain.train.summary import RunSummary, attach_reporters, summarize
from elastictrain.train.tiers import SnapshotTiers
from elastictrain.train.train_metrics import TrainMetrics, check_logged, evaluation_record

log = logging.getLogger("elastictrain")


class Session:
    """One process's part of an elastictrain run. ``config``: a Config, a dict, a YAML path or None
    (the defaults); ``overrides``: ``key.sub=value`` strings on top; ``observers`` get the run's events."""

    def __init__(self, config: Config | dict | str | None = None, overrides: Sequence[str] = (), *,
                 observers: Iterable[Observer] = ()) -> None:
        self.cfg = load_config(config, overrides)
        self.state = RunState(self.cfg.train.intra_op_threads, self.cfg.anomaly.skip_samples)
        self.machine = StateMachine()
        self.events = Observers([self.state.goodput, *observers])
        self.health = Health(self.cfg, self.state)
        self.anomalies = self.health.anomalies
        self.ctx: dist.DistContext | None = None
        self.tiers: SnapshotTiers | None = None
        self.summary: RunSummary | None = None
        self.grad_sync: Any = None  # set by wrap(model, loss_fn): the step runner's gradient sync
        self.registry = Registry()
        self.keys = LoopKeys(self.cfg)  # train.autocast_dtype, data.val_batch_size: applied when the loop asks
        self._data: TrainData | None = None
        self._evaluate: Callable[[], dict[str, float]] | None = None
        self._epoch_end: list[Callable[[], None]] = []
        self._rank_label = "?"  # known once SETUP has read the launch environment
        self._peer_lost = False
        self._left = False  # the with block has ended
        self._marks_ahead = False  # a step runner marks survivor copies itself (rank_state_final)
        self.machine.on()(self.events.transition)
        self.machine.on(dst=State.DONE)(self._summarize)
        self.machine.on(dst=State.PREEMPTED)(self._preempted)
        self.machine.on(src=State.SETUP)(lambda src, dst, step: self.health.signals.hold())  # a signal is voted on now

    # -- where the run is --------------------------------------------------------------------

    progress = property(lambda self: self.state.progress)
    history = property(lambda self: self.state.history)
    global_step = property(lambda self: self.state.progress.global_step)
    epoch = property(lambda self: self.state.progress.epoch)
    device = property(lambda self: self._context().device)
    rank = property(lambda self: self._context().rank)
    world_size = property(lambda self: self._context().world_size)
    is_main = property(lambda self: self._context().is_main)

    done = property(lambda self: self.machine.finished)  # DONE (or stopped): no more steps
    # Micro-batches per optimizer step: train.grad_accum_steps, or what the elastic policy chose at RESTORE.
    grad_accum_steps = property(lambda self: self.shard.grad_accum_steps)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run at its global batch (after a world-size change, the one the policy kept)."""
        if self._data is None and self.cfg.train.max_steps is None:  # 0 would be a scheduler's ZeroDivisionError
            raise UsageError("session.total_steps is known once session.loader() has the training set (or "
                             "train.max_steps is set): call session.loader() first")
        return self._run_steps(self.state.batch_geometry.global_batch)

    def _run_steps(self, global_batch: int | None) -> int:
        data = self._data
        return run_steps(self.cfg.train, None if data is None or data.stream else data.samples, self.ctx.world_size,
                         global_batch, self.state.progress)

    # -- SETUP -------------------------------------------------------------------------------

    def __enter__(self) -> Session:
        self._started, self._started_unix = time.monotonic(), time.time()
        self.health.signals.install(setting_up=True)  # until SETUP is left, a signal ends this rank at once
        try:
            self._setup()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _setup(self) -> None:
        launch = launch_env.detect_launch_env()
        self._rank_label = str(launch.rank)
        setup_logging(launch.rank, launch.restart_count, self.cfg.log)
        self.state.threads.start()
        self.ctx = dist.setup(self.cfg.dist)
        # log.jsonl once the process group is up: a run.dir it cannot write to is recorded for the restarts, which stop at once.
        setup_logging(launch.rank, launch.restart_count, self.cfg.log, run_dir=self.cfg.run_dir)
        self.machine.log_transitions = self.ctx.is_main
        if self.ctx.distributed and self.cfg.snapshot.durable.retry_for_s >= self.cfg.dist.collective_timeout_s:
            # The other ranks wait for rank 0's commit in one collective.
            raise ConfigError(
                f"snapshot.durable.retry_for_s={self.cfg.snapshot.durable.retry_for_s:g} must be below dist.collective_timeout_s="
                f"{self.cfg.dist.collective_timeout_s:g}; lower the first or raise the second"
            )
        lost_on_restart = launch_env.store_lost_on_restart(self.cfg.durable_snapshot_url, launch)
        if lost_on_restart:
            raise ConfigError(lost_on_restart)
        self.health.attach(self.ctx, self.events)
        attach_reporters(self.cfg, self.ctx, self.events, self.machine, self.state)
        planned = fit_to_world(self.cfg.train, self.ctx.world_size, BatchGeometry(), None)  # a fresh start's geometry
        self.shard = Shard(self.ctx.rank, self.ctx.world_size, self.cfg.train.batch_size, planned.grad_accum_steps)
        optimizers = self.registry.optimizers
        self.metrics = TrainMetrics(self.ctx, self.state, self.events, self.health.sync_timer,
                                    lr=lambda: optimizers()[0].param_groups[0]["lr"] if optimizers() else None)
        # What the loop builds now (models, an EMA copy) starts the same on every rank and every launch;
        # RESTORE then gives each rank its own streams (seed + rank) or the snapshot's.
        seed_rng(self.cfg.run.seed)

    def wrap(self, model: nn.Module, loss_fn: Callable | None = None) -> nn.Module:
        """The model on the session's device, under DDP when there are several workers.

        With ``loss_fn(model, batch)``, what comes back is a module whose ``forward(batch)`` is that
        loss inside DDP's forward (for ``StepRunner``; needed by ``train.virtual_shards``).
        """
        self._in_setup("wrap")
        before = dict(model.named_parameters())
        wrapped, sync = wrap_model_for(model, loss_fn, self.ctx, self.cfg, self.health.sync_timer)
        self.grad_sync = sync or self.grad_sync
        self.registry.wrapped.append(ddp.state_module(wrapped))
        self.registry.replaced.update(fsdp.replaced_parameters(before, model))  # FSDP's sharded parameters
        return wrapped

    def register(self, **statefuls: Any) -> None:
        """Everything that is state, by name: models, optimizers, schedulers, scalers, anything with
        ``state_dict()``/``load_state_dict()``. Saved in every snapshot, loaded by ``restore()``."""
        self._in_setup("register", "register everything that is state before restoring, or it would not be restored")
        for name, value in statefuls.items():
            self.registry.add(name, value)

    def loader(self, dataset: Dataset, collate_fn: Callable | None = None) -> Loader:
        """This rank's share of ``dataset``, ``train.batch_size`` samples a micro-batch, resumable mid-epoch."""
        self._in_setup("loader")
        if self._data is not None:
            raise UsageError("session.loader() was called twice: a run has one training set, whose position the "
                             "snapshots keep; build one loader")
        self._data = TrainData(dataset, collate_fn, self.cfg, self.ctx, self.state.progress, self.shard,
                               on_end_without_step=lambda: self._boundary(stepped=False),
                               skipped=self.state.anomalies.skipped_samples)
        return Loader(self._data, self._loader_finished)

    def val_loader(self, dataset: Dataset, collate_fn: Callable | None = None) -> DataLoader:
        """This rank's share of ``dataset`` (every sample once over all ranks; shards may be uneven), in batches
        of ``data.val_batch_size``: for your evaluation (reduce its sums across ranks yourself)."""
        self._in_setup("val_loader")
        self.keys.ask("data.val_batch_size")
        return validation_loader(dataset, collate_fn, self.ctx.rank, self.ctx.world_size, self.cfg)

    def evaluate_with(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """EVALUATE (every ``train.eval_every_epochs``, and at the end) calls ``evaluate()`` for metrics reduced
        across ranks; they are recorded as ``val_<name>``."""
        self._in_setup("evaluate_with")
        self._evaluate = evaluate

    def every_epoch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at each epoch's end, before any snapshot of that step (a per-epoch LR scheduler)."""
        self._in_setup("every_epoch")
        self._epoch_end.append(callback)

    # -- RESTORE -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Load the newest valid snapshot (both tiers) into everything registered; a fresh start without one."""
        self._in_setup("restore", "restore() is called once")
        self.model = model = self.registry.model()
        if self.ctx.is_main:  # said once for the run: what a resume would silently lose
            for warning in [*unregistered_state_named(self.registry.objects), *self.keys.at_restore(),
                            *idle_keys_line(self.cfg)]:
                log.warning("%s", warning)
        data = self._data
        if data is None and self.cfg.train.max_steps is None:
            raise ConfigError("a session without session.loader() has no epochs to end it: set train.max_steps")
        survivors_refused = None
        if not self.registry.optimizers() and not self._marks_ahead:
            survivors_refused = "no optimizer is registered, so a copy cannot tell a step half done"
        self.tiers = SnapshotTiers(
            self.cfg, self.ctx, model, {**self.registry.statefuls(), **self.state.statefuls()}, self.state, self.events,
            train_samples=data.samples if data else None,
            rank_statefuls={**(data.rank_statefuls if data else {}), "train_sums": self.metrics.sums},
            survivors_refused=survivors_refused, replicated=self.registry.objects)
        self.plan = Plan.of(self.cfg, epochs=data is not None, evaluates=self._evaluate is not None,
                            fast_tier=self.tiers.local is not None)
        ctx = self.ctx
        self.events.started(RunInfo.of(ctx, self.cfg.run_dir, self.total_steps))
        self.machine.transition(State.RESTORE, self.global_step)
        restored = self.tiers.restore()
        if restored is None:
            seed_rng(self.cfg.run.seed + ctx.rank)
            log.info("no snapshot at %s: starting fresh (world size %d)", self.tiers.url, ctx.world_size)
        # The batch policy on a world-size change (train.on_world_size_change) decides the accumulation.
        fit = fit_to_world(self.cfg.train, ctx.world_size, self.state.batch_geometry, restored.saved_world_size if restored else None)
        self.registry.build_schedulers(scheduler_steps(self.cfg.train, self._run_steps(fit.global_batch)),
                                       self.tiers.durable.statefuls)
        self.shard = apply_fit(fit, self.state.batch_geometry, ctx.rank, ctx.world_size, self.cfg.train,
                               self.registry.with_schedulers())
        if data is not None:
            data.shard = self.shard
        self.state.run_log.begin(
            restart_count=ctx.env.restart_count, world_size=ctx.world_size, start_step=self.global_step,
            launcher=ctx.env.launcher, started_unix=self._started_unix, restored=restored is not None,
        )
        self.events.restored(self.global_step, restored.duration_s if restored else 0.0, restored is not None)
        if self.cfg.track.mlflow_uri:  # rank 0's tracker run, in every rank's copies (a fast copy from any node)
            share_run_id(self.state.tracking, ctx, at_start=True)
        if ctx.is_main:
            log.info("%s", self.state.threads.report())
        self.tiers.begin(self._started_unix)
        self.metrics.begin()
        self._run(self._next_state(self.health.settle(self.tiers, self.global_step)))

    def registered(self, name: str) -> Any:
        """What is registered under ``name`` (after restore: a scheduler built from a factory)."""
        return self.registry.objects[name]

    # -- TRAIN -------------------------------------------------------------------------------

    def epochs(self) -> Iterator[int]:
        """The epochs left, from the restored one; ends when the run is done."""
        self._training("epochs")
        while not self.machine.finished:
            yield self.epoch

    def autocast(self) -> Any:
        """``train.autocast_dtype`` on the session's device, as a context for the forward and the loss."""
        self.keys.ask("train.autocast_dtype")
        return autocast(self.cfg.train.autocast_dtype, self.device)

    def log(self, samples: int = 1, **values: Any) -> None:
        """Add this rank's ``values`` (tensors or numbers), weighted by ``samples``, to the metrics reduced across
        ranks every train.log_every_steps (and recorded as ``train_<name>``). A non-finite ``loss`` is an anomaly."""
        check_logged("session.log", values)
        self.anomalies.loss(values.get("loss"), self.global_step + 1)
        self.metrics.add(samples, values)

    def gradients_ok(self, parameters: Any = None, *, loss: Any = None, norm: float | None = None) -> bool:
        """Call after the backward, before ``optimizer.step()``: False when this step's update must not be taken
        (this rank's ``loss`` of the step, or one logged before, is non-finite; the gradient norm is non-finite or
        spikes, anomaly.*; or the step is on the skip list), and then on every rank: the ranks agree on it (one
        1-element all-reduce), whatever each saw. With ``train.clip_grad_norm`` the gradients are clipped to it
        here when the update is taken, from the one norm also checked (``clip_grad_norm_``'s two halves, as
        ``Trainer`` clips; unscale a GradScaler's gradients first). ``parameters``: a module or parameters (default:
        every registered model's); ``norm``: their global gradient norm, if computed already (then no clipping)."""
        self._training("gradients_ok")
        step = self.global_step + 1
        clip = self.cfg.train.clip_grad_norm if norm is None else None
        if not self.anomalies.active and clip is None and step not in self.state.anomalies.skipped_steps:
            return True
        if norm is None and (clip is not None or self.anomalies.check_gradients):
            parameters = self.model if parameters is None else parameters
            parameters = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
            total = clipping_norm(parameters) if clip is not None else None
            norm = float(total) if total is not None else grad_norm(parameters)
        ok = self.anomalies.gradients_ok(norm, step, loss)
        if ok and clip is not None and total is not None:  # total: computed whenever clip is set
            torch.nn.utils.clip_grads_with_norm_(parameters, clip, total)
        return ok

    def rank_state_final(self) -> None:
        """For step runners, before a step's last backward: this rank's per-rank state (RNG, stream position,
        metric sums) is what it will be at the step's end, since backward and the optimizer step change none
        of it. A survivor copy then names the step the peers complete once this rank's gradients reach them."""
        self._marks_ahead = True
        self._mark(self.global_step + 1)

    def step(self, **values: Any) -> None:
        """After each optimizer step: advance, vote, and do what the ranks agreed (snapshot, evaluate, stop).

        ``values`` (e.g. ``loss=loss``) are logged weighted by the step's samples on this rank."""
        self._training("step")
        check_logged("session.step", values)
        for warning in self.keys.at_step() if self.ctx.is_main else ():
            log.warning("%s", warning)
        data = self._data
        if self.anomalies.active:
            self.anomalies.loss(values.get("loss"), self.global_step + 1)
            self.anomalies.stepped(self.global_step + 1, data.step_samples if data is not None else lambda: None)
        if data is not None:
            taken = data.take()
            if len(taken) != self.shard.grad_accum_steps:
                raise wrong_micro_batches(len(taken), self.shard.grad_accum_steps, self.cfg.train.grad_accum_steps)
            if values:
                self.metrics.add(sum(taken), values)
        elif values:
            self.metrics.add(1, values)
        self.metrics.stepped(time.perf_counter() - self._step_started)
        self.state.progress.advance(self.shard.samples_per_step if data is not None else 0)
        self.health.beat(self.global_step)
        self.state.goodput.stepped(self.global_step)
        if not self._marks_ahead:
            self._mark()
        self._boundary(stepped=True)

    def _boundary(self, stepped: bool) -> None:
        """After a step (or a stream's end): end the epoch, reduce, vote, and carry out the agreed next state."""
        step = self.global_step
        epoch_ended = self._data is not None and (self._data.epoch_ended or not stepped)
        if epoch_ended:
            self.state.progress.end_epoch()
            self._data.end_epoch()
            for callback in self._epoch_end:
                callback()
        if epoch_ended or step % self.cfg.train.log_every_steps == 0:
            self._reduce_train_metrics()
        self.health.announce(step)
        # The vote posted now is read at the next voting boundary: it overlaps the steps between.
        requests = self.health.post(self.tiers, step) | self.anomalies.due(step, self.tiers.local is not None)
        if self.anomalies.verifying(step):  # a replay at its anomalous step: every rank learns whether it recurred
            self.anomalies.weights(self.model.parameters(), step)
            requests |= self.health.settle(self.tiers, step)
            if not requests.anomaly:
                self.anomalies.replayed_clean(step)
        if requests.snapshot_failed:
            self.tiers.durable.raise_write_failure()
        if self._next_state(requests) is not State.TRAIN:
            # Leave TRAIN with nothing in flight and everything every rank asked for; never save non-finite weights.
            self.anomalies.weights(self.model.parameters(), step)
            state = self._next_state(requests | self.health.settle(self.tiers, step))
            # The run's end reduces what is left; a snapshot or a stop between two log steps holds each rank's sums
            # instead, so the history has a record at the log steps alone, as an unbroken run's (trackers show it).
            if self.metrics.pending and state is not State.ROLLBACK and run_finished(self.state.progress, self.plan):
                self._reduce_train_metrics()
            interval, paused = self.metrics.interval, time.monotonic()
            self._run(state)
            if self.metrics.interval is interval:  # an interval a snapshot falls in: its samples/s leave the pause out
                interval.started += time.monotonic() - paused
        self._step_started = time.perf_counter()

    # -- the states after TRAIN ---------------------------------------------------------------

    def _run(self, state: State) -> None:
        """Carry out states until TRAIN (return), DONE (return) or PREEMPTED (raise Preempted)."""
        while True:
            if state in (State.DONE, State.PREEMPTED):
                self.tiers.flush(state is State.DONE, self.global_step)
            self.machine.transition(state, self.global_step)
            if state is State.TRAIN:
                self._mark()  # this rank's part of a copy of this step, should a peer die before the next one
                self._step_started = time.perf_counter()
                return
            if state is State.DONE:
                return
            if state is State.PREEMPTED:
                raise Preempted(self.health.signals.requested or "signal", self.global_step)
            state = {State.EVALUATE: self._evaluate_now, State.SNAPSHOT: self._snapshot,
                     State.LOCAL_SNAPSHOT: self._local_snapshot, State.ROLLBACK: self._rollback}[state]()

    def _next_state(self, requests: Requests) -> State:
        if requests.preempt:  # recorded before the preemption snapshot: the next attempt reads this one as no failure
            self.state.run_log.current["preempted"] = 1
        return decide(self.state.progress, self.plan, requests)

    def _evaluate_now(self) -> State:
        assert self._evaluate is not None  # the plan evaluates only with an evaluation set up
        record = evaluation_record(self._evaluate())
        progress = self.state.progress
        progress.last_evaluated_step = progress.global_step
        self.history.append(step=progress.global_step, epoch=progress.epoch, **record)
        log.info("evaluated at step %d (epoch %d): %s", progress.global_step, progress.epoch,
                 " ".join(f"{k}={v:.4g}" for k, v in record.items()))
        self.events.evaluated(progress.global_step, progress.epoch, record)
        return self._next_state(self.health.settle(self.tiers, self.global_step))

    def _snapshot(self) -> State:
        self.tiers.take_durable(self._meta(), time.monotonic() - self._started)
        return self._next_state(self.health.settle(self.tiers, self.global_step))

    def _local_snapshot(self) -> State:
        self.tiers.take_local(self._meta(), time.monotonic() - self._started)
        # No vote here: the ranks agreed on everything when they left TRAIN, nothing is in flight, and
        # a request raised during the copy is read at the next voting step (a collective saved per copy).
        return self._next_state(NOTHING)

    def _rollback(self) -> State:
        """ROLLBACK: judge what every rank saw, restore the newest snapshot in this process, replay from there."""
        failpoints.hit("rollback", self.global_step)  # tests: a rank killed in the middle of a rollback
        rolled_from, started = self.global_step, time.monotonic()
        verdict = self.anomalies.agree()
        samples = self.anomalies.replayed_samples if verdict.action == "data" else None
        self.metrics.discard()  # the snapshot holds its own step's sums
        restored = self.tiers.roll_back(ROLLBACK_KEEPS)
        if restored is None:
            raise self.anomalies.nothing_to_roll_back_to(verdict)
        self.metrics.begin()
        # The skip list first: the data reopens with it.
        self.anomalies.rolled_back(verdict, samples, restored.step, self.shard.batch_size)
        if self._data is not None:
            self._data.reopen()
        self.events.rolled_back(rolled_from, restored.step, time.monotonic() - started)
        return self._next_state(self.health.settle(self.tiers, self.global_step))

    def _meta(self) -> dict[str, Any]:
        p = self.state.progress
        return {"epoch": p.epoch, "epoch_offset": p.epoch_offset, "world_size": self.ctx.world_size}

    def _reduce_train_metrics(self) -> None:
        self.metrics.reduce(self.shard.samples_per_step)
        self._mark()  # the sums are now in the history (and a stream's epoch may have ended)

    def _mark(self, step: int | None = None) -> None:
        if self.tiers is not None:
            self.tiers.mark(step, self.registry)

    # -- the end -----------------------------------------------------------------------------

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        replacement = None
        try:
            if exc is not None and not isinstance(exc, Preempted) or isinstance(exc, SignalledInSetup):
                replacement = self._fail(exc)
            elif exc is None and not self.machine.finished:
                report_left_early(self._rank_label, self.global_step, self.tiers.last_committed if self.tiers else None, self.ctx)
        finally:
            self._left = True  # what the loop calls from now on is a UsageError (_context)
            self.health.signals.uninstall()
            if self.tiers is not None:
                self.tiers.close()
            self.events.closed()
            if self._peer_lost:  # the launcher's SIGTERM, held for a snapshot a broken group cannot take, ends us now:
                self.health.signals.redeliver()  # before the teardown, which waits ~0.35 s on the dead peer's gloo pairs
            if self.ctx is not None:
                dist.teardown(self.ctx)
        if replacement is not None:
            raise replacement from None
        return False

    def _fail(self, exc: BaseException) -> BaseException | None:
        """Say in one line why this rank stopped (failures.py) and go to FAILED; a PeerLost or RepeatedCrash to raise
        instead."""
        state = self.machine.state
        replacement = report_failure(exc, self._rank_label, state.name, self.global_step, self.ctx,
                                     self.cfg.preempt.requeue)
        if isinstance(replacement, PeerLost):
            self._peer_lost = True
            if self.tiers is not None and state is State.TRAIN and self.anomalies.pending is None:
                self.tiers.write_survivor_copy(self._meta(), self._rank_label,
                                               time.monotonic() - self._started, self.registry, self._marks_ahead)
        if not self.machine.finished:
            self.machine.transition(State.FAILED, self.global_step)
        return replacement

    def _preempted(self, src: State, dst: State, step: int) -> None:
        self.state.run_log.current["preempted"] = 1
        self.health.preempted(step, self.tiers.last_committed)

    def _summarize(self, src: State, dst: State, step: int) -> None:
        self.summary = summarize(dst.name, self.state, self.model, self.ctx.world_size, self.ctx.env.restart_count,
                                 time.monotonic() - self._started)
        log.info("%s", self.summary.line())

    # -- helpers -----------------------------------------------------------------------------

    def _context(self, call: str = "") -> dist.DistContext:
        if self._left and call:  # rank, world_size, is_main still answer: a summary printed after the block asks them
            raise used_after_the_block(call)
        if self.ctx is None:
            raise UsageError("the session is not set up: use it as `with elastictrain.Session(config) as session:`")
        return self.ctx

    def _loader_finished(self) -> bool:
        self._context("iterating session.loader()'s loader")
        return self.machine.finished

    def _in_setup(self, call: str, why: str = "") -> None:
        self._context(f"session.{call}()")
        if self.machine.state is not State.SETUP:
            raise UsageError(f"session.{call}() after session.restore(): {why or 'set the session up before restoring'}")

    def _training(self, call: str) -> None:
        self._context(f"session.{call}()")
        if self.machine.state is State.SETUP:
            raise UsageError(f"session.{call}() before session.restore(): restore first (a fresh start when there is "
                             "no snapshot), so that training continues from the newest snapshot")


__all__ = ["RunSummary", "Session"]
