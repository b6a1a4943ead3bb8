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

The session is a facade: it checks each call and hands it to the object whose job it is. SETUP is here;
RESTORE is ``RestorePhase`` (restore_phase.py); ``step`` and the states after TRAIN (a snapshot, EVALUATE,
ROLLBACK, DONE, PREEMPTED) are ``StepDriver`` (driver.py); the end of the ``with`` block, an error said in
one line on the rank that had it and the teardown, is ``FailurePath`` (failure_path.py). Its public surface
is the calls below and the read-only facts of the run; docs/guides/custom-loops.md has the table.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import ddp, dist, fsdp, launch_env
from .anomalies import clipping_norm, grad_norm
from .collectives import all_gather, all_reduce, any_rank, broadcast_from_main
from .config import Config, load_config
from .config_view import ConfigView
from .data import Shard
from .driver import StepDriver
from .errors import ConfigError, UsageError
from .events import Observer, Observers
from .failure_path import FailurePath
from .failures import used_after_the_block
from .geometry import BatchGeometry, fit_to_world, run_steps
from .gradsync import wrap_model_for
from .health import Health
from .logs import setup_logging
from .loop_keys import LoopKeys, validation_loader
from .reduce import reduce_means
from .registry import Registry
from .restore_phase import RestorePhase
from .runner_link import RunnerLink
from .runstate import RunState
from .snapshot import seed_rng
from .states import State, StateMachine
from .step_runner import autocast
from .summary import RunSummary, attach_reporters
from .train_data import Loader, TrainData
from .train_metrics import TrainMetrics, check_logged

log = logging.getLogger("elastictrain")


class Session:
    """One process's part of an elastictrain run. ``config``: a Config, a dict, a YAML path or None
    (the defaults); ``overrides``: ``key.sub=value`` strings on top; ``observers`` get the run's events."""

    def __init__(self, config: Config | dict | str | None = None, overrides: list[str] = (), *,
                 observers: list[Observer] = ()) -> None:
        self._cfg = cfg = load_config(config, overrides)
        self._state = RunState(cfg.train.intra_op_threads, cfg.anomaly.skip_samples)
        self._machine = StateMachine()
        self._events = Observers([self._state.goodput, *observers])
        self._health = Health(cfg, self._state)
        self._ending = FailurePath(cfg, self._machine, self._health, self._events)
        self._registry, self._keys = Registry(), LoopKeys(cfg)  # keys: what is applied when the loop asks
        self._ctx: dist.DistContext | None = None
        self._shard: Shard | None = None  # this rank's batch geometry: a fresh start's at SETUP, the fitted one after
        self._metrics: TrainMetrics | None = None
        self._grad_sync: Any = None  # set by wrap(model, loss_fn): the step runner's gradient sync
        self._data: TrainData | None = None
        self._evaluate: Callable[[], dict[str, float]] | None = None
        self._epoch_end: list[Callable[[], None]] = []
        self._restoring: RestorePhase | None = None
        self._driver: StepDriver | None = None  # TRAIN and after: built at RESTORE's end
        self._rank_label = "?"  # known once SETUP has read the launch environment
        self._left = False  # the with block has ended
        self._started, self._started_unix = time.monotonic(), time.time()
        self._machine.on()(self._events.transition)
        self._machine.on(dst=State.DONE)(lambda *edge: self._driver.summarize(*edge))
        self._machine.on(dst=State.PREEMPTED)(lambda *edge: self._driver.preempted(*edge))
        self._machine.on(src=State.SETUP)(lambda *edge: self._health.signals.hold())  # a signal is voted on now

    # -- where the run is (read-only) ----------------------------------------------------------

    config = property(lambda self: ConfigView(self._cfg), doc="The run's Config, read-only.")
    progress = property(lambda self: self._state.progress, doc="Step, epoch and sample counters.")
    history = property(lambda self: self._state.history, doc="The reduced train_/val_ records, by step.")
    run_log = property(lambda self: self._state.run_log, doc="One record per attempt (restarts, wall time).")
    goodput = property(lambda self: self._state.goodput, doc="The goodput counters /metrics serves.")
    global_step = property(lambda self: self._state.progress.global_step)
    epoch = property(lambda self: self._state.progress.epoch)
    device = property(lambda self: self._context().device)
    rank = property(lambda self: self._context().rank)
    world_size = property(lambda self: self._context().world_size)
    is_main = property(lambda self: self._context().is_main)
    done = property(lambda self: self._machine.finished, doc="DONE (or stopped): no more steps.")
    summary = property(lambda self: self._driver and self._driver.summary, doc="The run's summary, at DONE.")
    # Micro-batches per optimizer step: train.grad_accum_steps, or what the elastic policy chose at RESTORE.
    grad_accum_steps = property(lambda self: self._shard.grad_accum_steps)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run at its global batch (after a world-size change, the one the policy kept)."""
        if self._data is None and self._cfg.train.max_steps is None:  # 0 would be a scheduler's ZeroDivisionError
            raise UsageError("session.total_steps is known once session.loader() has the training set (or "
                             "train.max_steps is set): call session.loader() first")
        return self._run_steps(self._state.batch_geometry.global_batch)

    def _run_steps(self, global_batch: int | None) -> int:
        data = self._data
        return run_steps(self._cfg.train, None if data is None or data.stream else data.samples, self._ctx.world_size,
                         global_batch, self._state.progress)

    # -- SETUP -------------------------------------------------------------------------------

    def __enter__(self) -> "Session":
        self._started, self._started_unix = time.monotonic(), time.time()
        self._health.signals.install(setting_up=True)  # until SETUP is left, a signal ends this rank at once
        try:
            self._setup()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _setup(self) -> None:
        cfg, launch = self._cfg, launch_env.detect_launch_env()
        self._rank_label = str(launch.rank)
        setup_logging(launch.rank, launch.restart_count, cfg.log)
        self._state.threads.start()
        self._ctx = ctx = dist.setup(cfg.dist)
        # log.jsonl once the process group is up: a run.dir it cannot write to is recorded for the restarts, which stop at once.
        setup_logging(launch.rank, launch.restart_count, cfg.log, run_dir=cfg.run_dir)
        self._machine.log_transitions = ctx.is_main
        if ctx.distributed and cfg.snapshot.durable.retry_for_s >= cfg.dist.collective_timeout_s:
            raise ConfigError(  # the other ranks wait for rank 0's commit in one collective
                f"snapshot.durable.retry_for_s={cfg.snapshot.durable.retry_for_s:g} must be below dist.collective_timeout_s="
                f"{cfg.dist.collective_timeout_s:g}; lower the first or raise the second")
        lost_on_restart = launch_env.store_lost_on_restart(cfg.durable_snapshot_url, launch)
        if lost_on_restart:
            raise ConfigError(lost_on_restart)
        self._health.attach(ctx, self._events)
        attach_reporters(cfg, ctx, self._events, self._machine, self._state)
        planned = fit_to_world(cfg.train, ctx.world_size, BatchGeometry(), None)  # a fresh start's geometry
        self._shard = Shard(ctx.rank, ctx.world_size, cfg.train.batch_size, planned.grad_accum_steps)
        optimizers = self._registry.optimizers
        self._metrics = TrainMetrics(ctx, self._state, self._events, self._health.sync_timer,
                                     lr=lambda: optimizers()[0].param_groups[0]["lr"] if optimizers() else None)
        # What the loop builds now (models, an EMA copy) starts the same on every rank and every launch;
        # RESTORE then gives each rank its own streams (seed + rank) or the snapshot's.
        seed_rng(cfg.run.seed)

    def wrap(self, model: nn.Module, loss_fn: Callable | None = None) -> nn.Module:
        """The model on the session's device, under DDP when there are several workers.

        With ``loss_fn(model, batch)``, what comes back is a module whose ``forward(batch)`` is that
        loss inside DDP's forward (for ``StepRunner``; needed by ``train.virtual_shards``).
        """
        self._in_setup("wrap")
        before = dict(model.named_parameters())
        wrapped, sync = wrap_model_for(model, loss_fn, self._ctx, self._cfg, self._health.sync_timer)
        self._grad_sync = sync or self._grad_sync
        self._registry.wrapped.append(ddp.state_module(wrapped))
        self._registry.replaced.update(fsdp.replaced_parameters(before, model))  # FSDP's sharded parameters
        return wrapped

    def register(self, **statefuls: Any) -> None:
        """Everything that is state, by name: models, optimizers, schedulers, scalers, anything with
        ``state_dict()``/``load_state_dict()``. Saved in every snapshot, loaded by ``restore()``."""
        self._in_setup("register", "register everything that is state before restoring, or it would not be restored")
        for name, value in statefuls.items():
            self._registry.add(name, value)

    def loader(self, dataset: Dataset, collate_fn: Callable | None = None) -> Loader:
        """This rank's share of ``dataset``, ``train.batch_size`` samples a micro-batch, resumable mid-epoch."""
        self._in_setup("loader")
        if self._data is not None:
            raise UsageError("session.loader() was called twice: a run has one training set, whose position the "
                             "snapshots keep; build one loader")
        self._data = TrainData(dataset, collate_fn, self._cfg, self._ctx, self._state.progress, self._shard,
                               on_end_without_step=lambda: self._driver.boundary(stepped=False),
                               skipped=self._state.anomalies.skipped_samples)
        return Loader(self._data, self._loader_finished)

    def val_loader(self, dataset: Dataset, collate_fn: Callable | None = None) -> DataLoader:
        """This rank's share of ``dataset`` (every sample once over all ranks; shards may be uneven), in batches
        of ``data.val_batch_size``: for your evaluation (reduce it with ``session.reduce_metrics``)."""
        self._in_setup("val_loader")
        self._keys.ask("data.val_batch_size")
        return validation_loader(dataset, collate_fn, self._ctx.rank, self._ctx.world_size, self._cfg)

    def evaluate_with(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """EVALUATE (every ``train.eval_every_epochs``, and at the end) calls ``evaluate()`` for metrics reduced
        across ranks (``session.reduce_metrics``); they are recorded as ``val_<name>``."""
        self._in_setup("evaluate_with")
        self._evaluate = evaluate

    def every_epoch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at each epoch's end, before any snapshot of that step (a per-epoch LR scheduler)."""
        self._in_setup("every_epoch")
        self._epoch_end.append(callback)

    def on(self, src: State | None = None, dst: State | None = None) -> Callable:
        """Decorator: run ``hook(src, dst, step)`` on every transition from ``src`` to ``dst`` (None: any state)."""
        return self._machine.on(src, dst)

    # -- RESTORE -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Load the newest valid snapshot (both tiers) into everything registered; a fresh start without one."""
        self._in_setup("restore", "restore() is called once")
        self._restoring = RestorePhase(self._cfg, self._ctx, self._state, self._machine, self._events,
                                       self._registry, self._metrics, self._keys)
        restored = self._restoring.run(self._data, self._evaluate is not None, self._started_unix, self._run_steps)
        self._shard = restored.shard
        self._driver = StepDriver(
            ctx=self._ctx, state=self._state, machine=self._machine, events=self._events, health=self._health,
            tiers=restored.tiers, plan=restored.plan, metrics=self._metrics, registry=self._registry,
            model=restored.model, data=self._data, shard=restored.shard, log_every_steps=self._cfg.train.log_every_steps,
            train_grad_accum=self._cfg.train.grad_accum_steps, evaluate=self._evaluate, epoch_end=self._epoch_end,
            started=self._started)
        self._driver.run(self._driver.settled_state())

    def registered(self, name: str) -> Any:
        """What is registered under ``name`` (after restore: a scheduler built from a factory)."""
        return self._registry.objects[name]

    # -- TRAIN -------------------------------------------------------------------------------

    def epochs(self) -> Iterator[int]:
        """The epochs left, from the restored one; ends when the run is done."""
        self._training("epochs")
        while not self._machine.finished:
            yield self.epoch

    def autocast(self) -> Any:
        """``train.autocast_dtype`` on the session's device, as a context for the forward and the loss."""
        self._keys.ask("train.autocast_dtype")
        return autocast(self._cfg.train.autocast_dtype, self.device)

    def log(self, samples: int = 1, **values: Any) -> None:
        """Add this rank's ``values`` (tensors or numbers), weighted by ``samples``, to the metrics reduced across
        ranks every train.log_every_steps (and recorded as ``train_<name>``). A non-finite ``loss`` is an anomaly."""
        check_logged("session.log", values)
        self._health.anomalies.loss(values.get("loss"), self.global_step + 1)
        self._metrics.add(samples, values)

    def gradients_ok(self, parameters: Any = None, *, loss: Any = None, norm: float | None = None) -> bool:
        """Call after the backward, before ``optimizer.step()``: False when this step's update must not be taken
        (this rank's ``loss`` of the step, or one logged before, is non-finite; the gradient norm is non-finite or
        spikes, anomaly.*; or the step is on the skip list), and then on every rank: the ranks agree on it (one
        1-element all-reduce), whatever each saw. With ``train.clip_grad_norm`` the gradients are clipped to it
        here when the update is taken, from the one norm also checked (``clip_grad_norm_``'s two halves, as
        ``Trainer`` clips; unscale a GradScaler's gradients first). ``parameters``: a module or parameters (default:
        every registered model's); ``norm``: their global gradient norm, if computed already (then no clipping)."""
        self._training("gradients_ok")
        step, anomalies = self.global_step + 1, self._health.anomalies
        clip = self._cfg.train.clip_grad_norm if norm is None else None
        if not anomalies.active and clip is None and step not in self._state.anomalies.skipped_steps:
            return True
        if norm is None and (clip is not None or anomalies.check_gradients):
            parameters = self._driver.model if parameters is None else parameters
            parameters = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
            total = clipping_norm(parameters) if clip is not None else None
            norm = float(total) if total is not None else grad_norm(parameters)
        ok = anomalies.gradients_ok(norm, step, loss)
        if ok and clip is not None:
            torch.nn.utils.clip_grads_with_norm_(parameters, clip, total)
        return ok

    def rank_state_final(self) -> None:
        """For step runners, before a step's last backward: this rank's per-rank state (RNG, stream position,
        metric sums) is what it will be at the step's end, since backward and the optimizer step change none
        of it. A survivor copy then names the step the peers complete once this rank's gradients reach them."""
        self._driver.marks_ahead = True
        self._driver.mark(self.global_step + 1)

    def step(self, **values: Any) -> None:
        """After each optimizer step: advance, vote, and do what the ranks agreed (snapshot, evaluate, stop).

        ``values`` (e.g. ``loss=loss``) are logged weighted by the step's samples on this rank."""
        self._training("step")
        check_logged("session.step", values)
        for warning in self._keys.at_step() if self._ctx.is_main else ():
            log.warning("%s", warning)
        self._driver.step(values)

    def runner_link(self) -> RunnerLink:
        """For step runners (``StepRunner``): the gradient sync ``wrap(model, loss_fn)`` built and the anomaly checks."""
        anomalies, ctx = self._health.anomalies, self._context("session.runner_link()")
        return RunnerLink(self._grad_sync, anomalies.check_gradients, anomalies.agree_ahead, lambda flag: any_rank(flag, ctx))

    # -- collectives: every rank calls them, in the same order ---------------------------------

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """``value`` (a tensor or a number) reduced over all ranks: ``op`` is sum, max, min or mean."""
        return all_reduce(value, op, self._context("session.all_reduce()"))

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (any picklable object), in rank order, on every rank."""
        return all_gather(obj, self._context("session.all_gather()"))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object) on every rank."""
        return broadcast_from_main(obj, self._context("session.broadcast()"), src)

    def reduce_metrics(self, metrics: dict[str, float], weight: float = 1) -> dict[str, float]:
        """Means over all ranks of this rank's ``metrics`` (its own means), each rank weighted by ``weight`` (its
        sample count): what ``evaluate_with``'s function returns. A rank may lack a name (it saw no sample)."""
        return reduce_means(metrics, weight, self._context("session.reduce_metrics()"))

    # -- the end -----------------------------------------------------------------------------

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        driver, tiers = self._driver, self._restoring and self._restoring.tiers
        try:
            replacement = self._ending.leave(exc, rank_label=self._rank_label, step=self.global_step, ctx=self._ctx,
                                             tiers=tiers, survivor_copy=driver and (
                                                 lambda: driver.write_survivor_copy(self._rank_label)))
        finally:
            self._left = True  # what the loop calls from now on is a UsageError (_context)
        if replacement is not None:
            raise replacement from None
        return False

    # -- call-order checks ---------------------------------------------------------------------

    def _context(self, call: str = "") -> dist.DistContext:
        if self._left and call:  # rank, world_size, is_main still answer: a summary printed after the block asks them
            raise used_after_the_block(call)
        if self._ctx is None:
            raise UsageError("the session is not set up: use it as `with elastictrain.Session(config) as session:`")
        return self._ctx

    def _loader_finished(self) -> bool:
        self._context("iterating session.loader()'s loader")
        return self._machine.finished

    def _in_setup(self, call: str, why: str = "") -> None:
        self._context(f"session.{call}()")
        if self._machine.state is not State.SETUP:
            raise UsageError(f"session.{call}() after session.restore(): {why or 'set the session up before restoring'}")

    def _training(self, call: str) -> None:
        self._context(f"session.{call}()")
        if self._machine.state is State.SETUP:
            raise UsageError(f"session.{call}() before session.restore(): restore first (a fresh start when there is "
                             "no snapshot), so that training continues from the newest snapshot")


__all__ = ["RunSummary", "Session"]
