"""The handler: hand ``Trainer`` a model, an optimizer, datasets and a loss function; ``fit()`` trains.

It is a short client of the custom-loop API (session.py), and reads like any training loop:

    with Session(config) as session:                       # SETUP
        model = session.wrap(model, loss_fn)               # DDP around model + loss
        session.register(model=..., optimizer=..., ...)    # the state every snapshot holds
        loader = session.loader(train_data)                # sharded, resumable position
        session.restore()                                  # RESTORE
        for epoch in session.epochs():                     # TRAIN
            for batches in loader.steps():
                runner.run(batches)                        # micro-batches, autocast, scaler, clip, scheduler
                session.step()                             # vote, snapshots, EVALUATE, DONE, PREEMPTED

Every guarantee lives in the session: exact resume, preemption with nothing lost, both snapshot
tiers, survivor copies, the watchdog, stragglers, goodput, metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from elastictrain.core.config import Config
from elastictrain.core.config_load import load_config
from elastictrain.core.events import Observer
from elastictrain.core.progress import Progress
from elastictrain.core.rng import seed_rng
from elastictrain.core.states import State
from elastictrain.data.geometry import run_steps, scheduler_steps
from elastictrain.data.sampling import batch_size_of, is_stream, samples_in, to_device
from elastictrain.dist import ddp
from elastictrain.dist import group as dist
from elastictrain.train.session import RunSummary, Session
from elastictrain.train.step_runner import StepRunner
from elastictrain.train.task import PendingScheduler, Task, load_task, split_loss

__all__ = ["RunSummary", "Trainer"]


class Trainer:
    """Launch the script with ``torchrun``, ``srun`` or plain ``python``: the environment decides the rest.

    ``config`` is a Config, a dict, a YAML path or None (the defaults); ``overrides`` are
    ``key.sub=value`` strings applied on top. ``lr_scheduler`` is a scheduler, or a factory
    ``(optimizer, total_steps) -> scheduler`` called once the world size is known, with the number
    of ``scheduler.step()`` calls the run will make. ``observers`` receive the run's events
    (``elastictrain.core.events``).
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
        overrides: Sequence[str] = (),
        observers: Iterable[Observer] = (),
    ) -> None:
        self.cfg = load_config(config, overrides)
        self.task = Task(model, optimizer, train_data, loss_fn, val_data, lr_scheduler, grad_scaler, collate_fn)
        self.session = Session(self.cfg, observers=observers)
        self._restored = False  # fit() has restored: the session knows the run's geometry

    @classmethod
    def from_task(
        cls,
        task: Task,
        config: Config | dict | str | None = None,
        overrides: Sequence[str] = (),
        observers: Iterable[Observer] = (),
    ) -> Trainer:
        return cls(
            task.model,
            task.optimizer,
            task.train_data,
            task.loss_fn,
            val_data=task.val_data,
            lr_scheduler=task.lr_scheduler,
            grad_scaler=task.grad_scaler,
            collate_fn=task.collate_fn,
            config=config,
            overrides=overrides,
            observers=observers,
        )

    @classmethod
    def from_config(cls, config: Config | dict | str | None = None, overrides: Sequence[str] = ()) -> Trainer:
        """Build the task the config names, seeded with ``run.seed`` so every run starts from the same weights."""
        cfg = load_config(config, overrides)
        seed_rng(cfg.run.seed)
        return cls.from_task(load_task(cfg.task), cfg)

    progress = property(lambda self: self.session.progress)
    history = property(lambda self: self.session.history)
    run_log = property(lambda self: self.session.run_log)
    summary = property(lambda self: self.session.summary)  # after fit(): what it returned

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run; before ``fit``, those of a fresh start at the launch's world size."""
        if self._restored:
            return self.session.total_steps
        data = self.task.train_data
        return run_steps(
            self.cfg.train,
            None if is_stream(data) else samples_in(data),
            dist.planned_world_size(self.cfg.dist),
            None,
            Progress(),
        )

    @property
    def scheduler_steps(self) -> int:
        """How often ``lr_scheduler.step()`` is called in the run: per step, or per epoch (train.lr_scheduler_interval)."""
        return scheduler_steps(self.cfg.train, self.total_steps)

    def on(self, src: State | None = None, dst: State | None = None) -> Callable:
        """Decorator: run ``hook(src, dst, step)`` on a transition (None matches any state)."""
        return self.session.on(src, dst)

    def fit(self) -> RunSummary:
        """Train to the end; raises ``Preempted`` (a SystemExit with code 143) after a preemption snapshot."""
        task, train = self.task, self.cfg.train
        with self.session as session:
            model = session.wrap(task.model, task.loss_fn)
            scaler = task.grad_scaler
            if scaler is None and train.autocast_dtype == "float16":
                scaler = torch.amp.GradScaler(session.device.type)
            scheduler = task.lr_scheduler
            if callable(scheduler) and not hasattr(
                scheduler, "state_dict"
            ):  # a factory: built once the run's length is known
                scheduler = PendingScheduler(scheduler, task.optimizer)
            session.register(model=task.model, optimizer=task.optimizer, lr_scheduler=scheduler, grad_scaler=scaler)
            loader = session.loader(task.train_data, task.collate_fn)
            if task.val_data is not None:
                val_loader = session.val_loader(task.val_data, task.collate_fn)
                session.evaluate_with(lambda: self._evaluate(session, model, val_loader))
            if train.lr_scheduler_interval == "epoch" and scheduler is not None:
                session.every_epoch(lambda: session.registered("lr_scheduler").step())
            session.restore()
            self._restored = True
            runner = StepRunner(
                session, model, task.optimizer, lr_scheduler=session.registered("lr_scheduler"), grad_scaler=scaler
            )
            for _epoch in session.epochs():
                model.train()
                for batches in loader.steps():
                    runner.run(batches)
                    session.step()
        return session.summary

    def _evaluate(self, session: Session, model: torch.nn.Module, loader: Any) -> dict[str, float]:
        """One pass over the validation set, each rank its share; sample-weighted means over all ranks."""
        plain = ddp.unwrap(model)  # no DDP here: shards may be uneven, so no per-forward collective
        plain.eval()
        # FSDP gathers each block's weights in its forward, a collective: through the sharded root, every rank
        # runs as many forwards (the extra ones repeat its last batch and count nothing).
        sharded = self.cfg.dist.strategy == "fsdp" and session.world_size > 1
        forwards = max(session.all_gather(len(loader))) if sharded else 0
        count, batch = 0, None
        sums: dict[str, float] = {}
        with torch.no_grad(), session.autocast():
            for batch in loader:
                batch = to_device(batch, session.device)
                samples = batch_size_of(batch)
                loss, metrics = split_loss(model(batch) if sharded else self.task.loss_fn(plain, batch))
                for name, value in {"loss": loss, **metrics}.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * samples
                count += samples
            for _ in range(forwards - len(loader)):
                model(batch)
        model.train()
        return session.reduce_metrics(
            {name: total / count for name, total in sums.items()} if count else {}, weight=count
        )
