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

A facade: each call is checked (call_order.py) and handed to the object whose job it is: SETUP to ``SetupPhase``,
RESTORE to ``RestorePhase``, ``step`` and the states after TRAIN to ``StepDriver`` (driver.py), the ``with`` block's
end (an error in one line, the teardown) to ``FailurePath``. docs/guides/custom-loops.md tables the public surface.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset

from elastictrain.core.config import Config
from elastictrain.core.config_load import load_config
from elastictrain.core.config_view import ConfigView
from elastictrain.core.events import Observer, Observers
from elastictrain.core.heap import SetupHeap
from elastictrain.core.states import State, StateMachine
from elastictrain.data.train_data import Loader
from elastictrain.dist.collectives import any_rank
from elastictrain.train.call_order import CallOrder
from elastictrain.train.driver import StepDriver
from elastictrain.train.failure_path import FailurePath
from elastictrain.train.health import Health
from elastictrain.train.loop_keys import LoopKeys, validation_loader
from elastictrain.train.registry import Registry
from elastictrain.train.restore_phase import RestorePhase
from elastictrain.train.runner_link import RunnerLink
from elastictrain.train.runstate import RunState
from elastictrain.train.session_collectives import SessionCollectives
from elastictrain.train.setup_phase import SetupPhase
from elastictrain.train.step_runner import autocast
from elastictrain.train.summary import RunSummary
from elastictrain.train.train_metrics import check_logged

log = logging.getLogger("elastictrain")


class Session(SessionCollectives):
    """One process's part of an elastictrain run. ``config``: a Config, a dict, a YAML path or None
    (the defaults); ``overrides``: ``key.sub=value`` strings on top; ``observers`` get the run's events.
    Its collectives (``all_reduce``, ``all_gather``, ``broadcast``, ``reduce_metrics``): ``SessionCollectives``."""

    def __init__(
        self,
        config: Config | dict | str | None = None,
        overrides: Sequence[str] = (),
        *,
        observers: Iterable[Observer] = (),
    ) -> None:
        self._cfg = cfg = load_config(config, overrides)
        self._state = RunState(cfg.train.intra_op_threads, cfg.anomaly.skip_samples)
        self._machine = StateMachine()
        self._events = Observers([self._state.goodput, *observers])
        self._health = Health(cfg, self._state)
        self._registry, self._keys = Registry(), LoopKeys(cfg)  # keys: what is applied when the loop asks
        self._setting_up = SetupPhase(cfg, self._state, self._machine, self._events, self._health, self._registry)
        self._calls = CallOrder(self._machine, lambda: self._setting_up.ctx)
        self._ending = FailurePath(cfg, self._machine, self._health, self._events)
        self._evaluate: Callable[[], dict[str, float]] | None = None
        self._epoch_end: list[Callable[[], None]] = []
        self._restoring: RestorePhase | None = None
        self._driver: StepDriver | None = None  # TRAIN and after: built at RESTORE's end
        self._heap = SetupHeap()  # start-up's objects out of the collector's full passes while training
        self._started, self._started_unix = time.monotonic(), time.time()
        self._machine.on(dst=State.DONE)(lambda *edge: self._steps.summarize(*edge))
        self._machine.on(dst=State.PREEMPTED)(lambda *edge: self._steps.preempted(*edge))

    @property
    def _steps(self) -> StepDriver:
        """The driver of TRAIN and after; CallOrder lets no call that needs it through before RESTORE built it."""
        assert self._driver is not None, "a TRAIN call reached the session before RESTORE built its driver"
        return self._driver

    # -- where the run is (read-only) ----------------------------------------------------------

    config = property(lambda self: ConfigView(self._cfg), doc="The run's Config, read-only.")
    progress = property(lambda self: self._state.progress, doc="Step, epoch and sample counters.")
    history = property(lambda self: self._state.history, doc="The reduced train_/val_ records, by step.")
    run_log = property(lambda self: self._state.run_log, doc="One record per attempt (restarts, wall time).")
    goodput = property(lambda self: self._state.goodput, doc="The goodput counters /metrics serves.")
    global_step = property(lambda self: self._state.progress.global_step)
    epoch = property(lambda self: self._state.progress.epoch)
    device = property(lambda self: self._calls.context().device)
    rank = property(lambda self: self._calls.context().rank)
    world_size = property(lambda self: self._calls.context().world_size)
    is_main = property(lambda self: self._calls.context().is_main)
    done = property(lambda self: self._machine.finished, doc="DONE (or stopped): no more steps.")
    summary = property(lambda self: self._driver and self._driver.summary, doc="The run's summary, at DONE.")
    # Micro-batches per optimizer step: train.grad_accum_steps, or what the elastic policy chose at RESTORE.
    grad_accum_steps = property(lambda self: self._shard.grad_accum_steps)
    _ctx = property(lambda self: self._setting_up.ctx)
    _shard = property(lambda self: self._driver.shard if self._driver else self._setting_up.shard)
    _metrics = property(lambda self: self._setting_up.metrics)
    _data = property(lambda self: self._setting_up.data)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run at its global batch (after a world-size change, the one the policy kept)."""
        return self._setting_up.run_steps(self._state.batch_geometry.global_batch)

    # -- SETUP -------------------------------------------------------------------------------

    def __enter__(self) -> Session:
        self._started, self._started_unix = time.monotonic(), time.time()
        self._health.signals.install(setting_up=True)  # until SETUP is left, a signal ends this rank at once
        try:
            self._setting_up.run()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def wrap(self, model: nn.Module, loss_fn: Callable | None = None) -> nn.Module:
        """The model on the session's device, under DDP when there are several workers.

        With ``loss_fn(model, batch)``, what comes back is a module whose ``forward(batch)`` is that
        loss inside DDP's forward (for ``StepRunner``; needed by ``train.virtual_shards``).
        """
        self._calls.in_setup("wrap")
        return self._setting_up.wrap(model, loss_fn)

    def register(self, **statefuls: Any) -> None:
        """Everything that is state, by name: models, optimizers, schedulers, scalers, anything with
        ``state_dict()``/``load_state_dict()``. Saved in every snapshot, loaded by ``restore()``."""
        self._calls.in_setup(
            "register", "register everything that is state before restoring, or it would not be restored"
        )
        for name, value in statefuls.items():
            self._registry.add(name, value)

    def loader(self, dataset: Dataset, collate_fn: Callable | None = None) -> Loader:
        """This rank's share of ``dataset``, ``train.batch_size`` samples a micro-batch, resumable mid-epoch."""
        self._calls.in_setup("loader")
        data = self._setting_up.loader(dataset, collate_fn, lambda: self._steps.boundary(stepped=False))
        return Loader(data, self._calls.loader_finished)

    def val_loader(self, dataset: Dataset, collate_fn: Callable | None = None) -> DataLoader:
        """This rank's share of ``dataset`` (every sample once over all ranks; shards may be uneven), in batches
        of ``data.val_batch_size``: for your evaluation (reduce it with ``session.reduce_metrics``)."""
        self._calls.in_setup("val_loader")
        self._keys.ask("data.val_batch_size")
        return validation_loader(dataset, collate_fn, self._ctx.rank, self._ctx.world_size, self._cfg)

    def evaluate_with(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """EVALUATE (every ``train.eval_every_epochs``, and at the end) calls ``evaluate()`` for metrics reduced
        across ranks (``session.reduce_metrics``); they are recorded as ``val_<name>``."""
        self._calls.in_setup("evaluate_with")
        self._evaluate = evaluate

    def every_epoch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` at each epoch's end, before any snapshot of that step (a per-epoch LR scheduler)."""
        self._calls.in_setup("every_epoch")
        self._epoch_end.append(callback)

    def on(self, src: State | None = None, dst: State | None = None) -> Callable:
        """Decorator: run ``hook(src, dst, step)`` on every transition from ``src`` to ``dst`` (None: any state)."""
        return self._machine.on(src, dst)

    # -- RESTORE -----------------------------------------------------------------------------

    def restore(self) -> None:
        """Load the newest valid snapshot (both tiers) into everything registered; a fresh start without one."""
        self._calls.in_setup("restore", "restore() is called once")
        self._restoring = RestorePhase(
            self._cfg, self._ctx, self._state, self._machine, self._events, self._registry, self._metrics, self._keys
        )
        restored = self._restoring.run(
            self._data, self._evaluate is not None, self._started_unix, self._setting_up.run_steps
        )
        self._driver = StepDriver(restored, self._setting_up, self._evaluate, self._epoch_end, self._started)
        self._driver.run(self._driver.settled_state())
        self._heap.freeze()

    def registered(self, name: str) -> Any:
        """What is registered under ``name`` (after restore: a scheduler built from a factory)."""
        return self._registry.objects[name]

    # -- TRAIN -------------------------------------------------------------------------------

    def epochs(self) -> Iterator[int]:
        """The epochs left, from the restored one; ends when the run is done."""
        self._calls.training("epochs")
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
        """After the backward (and a GradScaler's ``unscale_``), before ``optimizer.step()``: False when this step's
        update must not be taken: a non-finite ``loss``, a non-finite or spiking gradient norm of ``parameters``
        (default: every registered model's), a listed step. The same on every rank under ``anomaly.policy=skip``;
        each rank's own under rollback. Clips to ``train.clip_grad_norm`` when it is taken, unless ``norm`` (already
        computed) is given. The custom-loop guide says it in full."""
        self._calls.training("gradients_ok")
        return self._steps.gradients_ok(parameters, loss, norm)

    def rank_state_final(self) -> None:
        """For step runners, before a step's last backward: this rank's per-rank state (RNG, stream position, sums)
        is final for the step, so a survivor copy names the step the peers complete with this rank's gradients."""
        self._steps.marks_ahead = True
        self._steps.mark(self.global_step + 1)

    def step(self, **values: Any) -> None:
        """After each optimizer step: advance, vote, and do what the ranks agreed (snapshot, evaluate, stop).

        ``values`` (e.g. ``loss=loss``) are logged weighted by the step's samples on this rank."""
        self._calls.training("step")
        check_logged("session.step", values)
        for warning in self._keys.at_step() if self._ctx.is_main else ():
            log.warning("%s", warning)
        self._steps.step(values)

    def runner_link(self) -> RunnerLink:
        """For step runners (``StepRunner``): the gradient sync ``wrap(model, loss_fn)`` built and the anomaly checks."""
        anomalies, ctx = self._health.anomalies, self._calls.context("session.runner_link()")
        return RunnerLink(
            self._setting_up.grad_sync,
            anomalies.check_gradients,
            anomalies.agree_ahead,
            lambda flag: any_rank(flag, ctx),
        )

    # -- the end -----------------------------------------------------------------------------

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        driver, tiers = self._driver, self._restoring.tiers if self._restoring is not None else None
        try:
            label = self._setting_up.rank_label
            survivor_copy = (lambda: driver.write_survivor_copy(label)) if driver is not None else None
            replacement = self._ending.leave(
                exc, rank_label=label, step=self.global_step, ctx=self._ctx, tiers=tiers, survivor_copy=survivor_copy
            )
        finally:
            self._calls.left = True  # what the loop calls from now on is a UsageError (call_order.py)
            self._heap.release()
        if replacement is not None:
            raise replacement from None
        return False


__all__ = ["RunSummary", "Session"]
