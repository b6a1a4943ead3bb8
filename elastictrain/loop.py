"""The worker loop: one state machine, one snapshot, exact resume.

``Trainer.fit`` runs SETUP -> RESTORE -> (TRAIN | EVALUATE | SNAPSHOT)* -> DONE. Each state is
one method that does its work and returns the next state; ``decide`` (pure, table-tested) says
what comes after training, evaluating or snapshotting, from the progress counters alone, so
every rank takes the same path and a resumed worker takes the path an unbroken one would.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset

from . import dist, errors
from .config import Config, load_config
from .data import EvalBatchSampler, Shard, ShardedBatchSampler, batch_size_of, make_loader, steps_in_epoch, to_device
from .errors import ConfigError, ElastictrainError, SnapshotError
from .logs import progress_bar, setup_logging
from .reduce import WeightedSums, reduce_objects
from .snapshot import (
    FORMAT_VERSION,
    MODEL_OBJECT,
    STATE_OBJECT,
    History,
    Progress,
    capture_rng,
    load_model_weights,
    load_object,
    params_sha256,
    restore_rng,
    seed_rng,
    writer_for,
)
from .states import State, StateMachine
from .storage import Manifest, SnapshotStore
from .task import Task, load_task, split_loss

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


def decide(progress: Progress, plan: Plan, snapshot_requested: bool = False) -> State:
    """What follows TRAIN, EVALUATE, SNAPSHOT or RESTORE, given where training is."""
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
    snapshot_due = progress.last_snapshot_step != progress.global_step and (
        snapshot_requested
        or (plan.snapshot_every_steps > 0 and progress.global_step % plan.snapshot_every_steps == 0 and progress.global_step > 0)
        or (finished and plan.snapshot_on_done)
    )
    if snapshot_due:
        return State.SNAPSHOT
    return State.DONE if finished else State.TRAIN


@dataclass
class RunSummary:
    state: str
    global_step: int
    epoch: int
    world_size: int
    restart_count: int
    train_loss: float | None
    val_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    params_sha256: str = ""
    wall_s: float = 0.0

    def line(self) -> str:
        values = {"train_loss": self.train_loss, "val_loss": self.val_loss, **self.val_metrics}
        shown = " ".join(f"{k}={v:.4f}" for k, v in values.items() if v is not None)
        return (
            f"run summary: state={self.state} step={self.global_step} epoch={self.epoch} "
            f"world_size={self.world_size} restart={self.restart_count} {shown} "
            f"wall_s={self.wall_s:.1f} params_sha256={self.params_sha256}"
        )


class Trainer:
    """Hand it a model, optimizer, datasets and a loss function; ``fit()`` trains and survives restarts.

    Launch the script with ``torchrun``, ``srun`` or plain ``python``: the environment decides
    the rest (``dist.distributed`` overrides). ``config`` is a Config, a dict, a YAML path or
    None (the defaults); ``overrides`` are ``key.sub=value`` strings applied on top.
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
    ) -> None:
        self.cfg = load_config(config, list(overrides))
        self.task = Task(model, optimizer, train_data, loss_fn, val_data, lr_scheduler, grad_scaler, collate_fn)
        self.progress = Progress()
        self.history = History()
        self.machine = StateMachine()
        self.summary: RunSummary | None = None
        self.machine.on(dst=State.DONE)(self._summarize)
        self._actions: dict[State, Callable[[], State]] = {
            State.SETUP: self._setup,
            State.RESTORE: self._restore,
            State.TRAIN: self._train,
            State.EVALUATE: self._evaluate,
            State.SNAPSHOT: self._snapshot,
        }

    @classmethod
    def from_task(cls, task: Task, config: Config | dict | str | None = None, overrides: list[str] = ()) -> "Trainer":
        return cls(
            task.model, task.optimizer, task.train_data, task.loss_fn,
            val_data=task.val_data, lr_scheduler=task.lr_scheduler, grad_scaler=task.grad_scaler,
            collate_fn=task.collate_fn, config=config, overrides=overrides,
        )

    @classmethod
    def from_config(cls, config: Config | dict | str | None = None, overrides: list[str] = ()) -> "Trainer":
        """Build the task the config names, seeded with ``run.seed`` so every run starts from the same weights."""
        cfg = load_config(config, list(overrides))
        seed_rng(cfg.run.seed)
        return cls.from_task(load_task(cfg.task), cfg)

    def on(self, src: State | None = None, dst: State | None = None) -> Callable:
        """Decorator: run ``hook(src, dst, step)`` on a transition (None matches any state)."""
        return self.machine.on(src, dst)

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        self._started = time.monotonic()
        self.ctx: dist.DistContext | None = None
        self._rank_label = "?"  # known once SETUP has read the launch environment
        try:
            while not self.machine.finished:
                next_state = self._actions[self.machine.state]()
                self.machine.transition(next_state, self.progress.global_step)
        except BaseException as exc:
            where = (self._rank_label, self.machine.state.name, self.progress.global_step)
            if isinstance(exc, ElastictrainError):
                log.error("rank %s stopped in state %s at step %d: %s", *where, exc)
            else:
                log.exception("rank %s failed in state %s at step %d", *where)
            if not self.machine.finished:
                self.machine.transition(State.FAILED, self.progress.global_step)
            raise
        finally:
            if getattr(self, "_bar", None) is not None:
                self._bar.close()
            if self.ctx is not None:
                dist.teardown(self.ctx)
        return self.summary

    # -- states -----------------------------------------------------------------------------

    def _setup(self) -> State:
        launch = dist.detect_launch_env()
        self._rank_label = str(launch.rank)
        setup_logging(launch.rank, launch.restart_count, self.cfg.log)
        self.ctx = dist.setup(self.cfg.dist)
        self.machine.log_transitions = self.ctx.is_main
        train = self.cfg.train
        self.shard = Shard(self.ctx.rank, self.ctx.world_size, train.batch_size, train.grad_accum_steps)
        if steps_in_epoch(len(self.task.train_data), self.shard) == 0:
            raise ConfigError(
                f"the training set has {len(self.task.train_data)} samples, fewer than one optimizer step takes "
                f"({self.shard.samples_per_step} = train.batch_size x world size x train.grad_accum_steps); lower train.batch_size"
            )
        self.model = dist.wrap_model(self.task.model, self.ctx, self.cfg.dist)
        self.scaler = self.task.grad_scaler
        if self.scaler is None and train.autocast_dtype == "float16":
            self.scaler = torch.amp.GradScaler(self.ctx.device.type)
        self.store = SnapshotStore(self.cfg.snapshot_url, self.cfg.snapshot.storage_options)
        self.plan = Plan(
            train.max_epochs, train.max_steps, train.eval_every_epochs, self.task.val_data is not None,
            self.cfg.snapshot.every_steps, self.cfg.snapshot.on_done,
        )
        self._train_sums = WeightedSums(self.ctx.device)
        self._batches: Iterator | None = None
        self._steps_left = 0
        self._snapshot_requested = False
        self._last_snapshot_time = time.monotonic()
        self._bar = None
        return State.RESTORE

    def _restore(self) -> State:
        # Rank 0 alone reads and verifies storage and hands the bytes to every rank: one read
        # per restore instead of one per rank, and every rank loads the very same snapshot.
        found, error = None, None
        if self.ctx.is_main:
            try:
                self.store.check_writable()
                if self.cfg.snapshot.resume:
                    found = self.store.latest_valid()
                elif self.store.list_snapshots():
                    # A fresh run writing beside another run's snapshots would mix the two.
                    raise SnapshotError(
                        f"snapshot.resume=false but {self.store.url} already holds snapshots; point snapshot.url "
                        "(or run.name) somewhere empty, or remove them — nothing was deleted"
                    )
            except ElastictrainError as exc:
                error = (type(exc).__name__, str(exc))
        found, error = dist.broadcast_from_main((found, error), self.ctx)
        if error is not None:
            raise getattr(errors, error[0], ElastictrainError)(error[1])
        if found is None:
            seed_rng(self.cfg.run.seed + self.ctx.rank)
            log.info("no snapshot at %s: starting fresh (world size %d)", self.store.url, self.ctx.world_size)
        else:
            self._load_snapshot(*found)
        self._bar = progress_bar(self.cfg.log.progress_bar, self.ctx.is_main, self._total_steps(), self.progress.global_step)
        return decide(self.progress, self.plan)

    def _train(self) -> State:
        self.model.train()
        while True:
            if self._batches is None:
                self._open_epoch()
            # After a restore into a larger world the rest of an epoch can be under one step.
            if self._steps_left > 0:
                self._train_step()
                self._steps_left -= 1
            epoch_ended = self._steps_left == 0
            if epoch_ended:
                self._end_epoch()
            if epoch_ended or self.progress.global_step % self.cfg.train.log_every_steps == 0:
                self._reduce_train_metrics()
            next_state = decide(self.progress, self.plan, self._snapshot_requested)
            if next_state is not State.TRAIN:
                if self._train_sums.count:
                    self._reduce_train_metrics()
                    next_state = decide(self.progress, self.plan, self._snapshot_requested)
                return next_state

    def _evaluate(self) -> State:
        model = dist.unwrap(self.model)  # no DDP here: shards may be uneven, so no per-forward collective
        model.eval()
        sampler = EvalBatchSampler(len(self.task.val_data), self.ctx.rank, self.ctx.world_size, self.cfg.data.val_batch_size)
        loader = make_loader(self.task.val_data, sampler, self.cfg.data.num_workers, self.cfg.run.seed, self.task.collate_fn)
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
        self.model.train()
        return decide(self.progress, self.plan, self._snapshot_requested)

    def _snapshot(self) -> State:
        started = time.monotonic()
        self.progress.last_snapshot_step = self.progress.global_step
        rng_states = dist.gather_to_main(capture_rng(self.ctx.device), self.ctx)
        if self.ctx.is_main:
            manifest = self.store.commit(
                self.progress.global_step,
                {
                    MODEL_OBJECT: writer_for(dist.unwrap(self.model).state_dict()),
                    STATE_OBJECT: writer_for(self._state_dict(rng_states)),
                },
                meta={
                    "epoch": self.progress.epoch,
                    "epoch_offset": self.progress.epoch_offset,
                    "world_size": self.ctx.world_size,
                    "format_version": FORMAT_VERSION,
                },
            )
            pruned = self.store.prune(self.cfg.snapshot.keep_last)
            size = sum(entry.size for entry in manifest.objects.values())
            log.info(
                "snapshot %s/%s committed: %d bytes in %.3fs%s", self.store.url, manifest.snapshot_id, size,
                time.monotonic() - started, f" (pruned {', '.join(pruned)})" if pruned else "",
            )
        self._snapshot_requested = False
        self._last_snapshot_time = time.monotonic()
        return decide(self.progress, self.plan)

    # -- training steps -------------------------------------------------------------------

    def _open_epoch(self) -> None:
        sampler = ShardedBatchSampler(
            len(self.task.train_data), self.shard, self.cfg.run.seed, self.progress.epoch,
            self.progress.epoch_offset, self.cfg.data.shuffle,
        )
        loader = make_loader(
            self.task.train_data, sampler, self.cfg.data.num_workers,
            self.cfg.run.seed + self.progress.epoch, self.task.collate_fn,
        )
        self._batches = iter(loader)
        self._steps_left = sampler.steps

    def _end_epoch(self) -> None:
        self.progress.end_epoch()
        self._batches = None
        if self.task.lr_scheduler is not None and self.cfg.train.lr_scheduler_interval == "epoch":
            self.task.lr_scheduler.step()

    def _train_step(self) -> None:
        accum = self.cfg.train.grad_accum_steps
        optimizer, scaler = self.task.optimizer, self.scaler
        for micro in range(accum):
            batch = to_device(next(self._batches), self.ctx.device)
            with dist.no_sync(self.model, skip_sync=micro < accum - 1):
                with self._autocast():
                    loss, metrics = split_loss(self.task.loss_fn(self.model, batch))
                scaled = loss / accum
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            self._train_sums.add(batch_size_of(batch), {"loss": loss, **metrics})
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
        if self._bar is not None:
            self._bar.update(1)

    def _reduce_train_metrics(self) -> None:
        # Rank 0's clock alone decides time-based snapshots; the flag rides in the metrics'
        # all_reduce, so every rank agrees without a collective of its own.
        every_s = self.cfg.snapshot.every_seconds
        timer_fired = self.ctx.is_main and every_s > 0 and time.monotonic() - self._last_snapshot_time >= every_s
        means, (timer_votes,) = self._train_sums.reduce(self.ctx, [1.0 if timer_fired else 0.0])
        self._snapshot_requested |= timer_votes > 0
        if not means:
            return
        record = {f"train_{name}": value for name, value in means.items()}
        record["lr"] = self.task.optimizer.param_groups[0]["lr"]
        self.history.append(step=self.progress.global_step, epoch=self.progress.epoch, **record)
        if self._bar is not None:
            self._bar.set_postfix(epoch=self.progress.epoch, loss=f"{means['loss']:.4f}")
        else:
            log.info("step %d epoch %d %s", self.progress.global_step, self.progress.epoch, _fmt(record))

    def _autocast(self) -> Any:
        dtype = self.cfg.train.autocast_dtype
        if dtype == "none":
            return nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=getattr(torch, dtype))

    def _total_steps(self) -> int:
        per_epoch = steps_in_epoch(len(self.task.train_data), self.shard)
        total = per_epoch * self.cfg.train.max_epochs
        return min(total, self.cfg.train.max_steps) if self.cfg.train.max_steps else total

    # -- the snapshot ---------------------------------------------------------------------

    def _state_dict(self, rng_states: list[dict]) -> dict[str, Any]:
        """Everything but the model weights; the model is its own payload object."""
        return {
            "format_version": FORMAT_VERSION,
            "optimizer": self.task.optimizer.state_dict(),
            "lr_scheduler": self.task.lr_scheduler.state_dict() if self.task.lr_scheduler is not None else None,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "progress": self.progress.state_dict(),
            "history": self.history.state_dict(),
            "rng": rng_states,
            "config": self.cfg.to_dict(),
            "env": {
                "world_size": self.ctx.world_size,
                "num_threads": torch.get_num_threads(),
                "torch_version": str(torch.__version__),  # TorchVersion is not a plain str
            },
        }

    def _load_snapshot(self, manifest: Manifest, objects: dict[str, bytes]) -> None:
        where = f"snapshot {self.store.url}/{manifest.snapshot_id}"
        for name in (MODEL_OBJECT, STATE_OBJECT):
            if name not in objects:
                raise SnapshotError(f"{where} has no {name!r} object; it was not written by elastictrain")
        weights = load_object(objects[MODEL_OBJECT], where, self.ctx.device)
        state = load_object(objects[STATE_OBJECT], where, self.ctx.device)
        if state.get("format_version") != FORMAT_VERSION:
            raise SnapshotError(
                f"{where} has format {state.get('format_version')}, this elastictrain reads format {FORMAT_VERSION}; "
                "use the elastictrain version that wrote it, or set snapshot.resume=false to start fresh"
            )
        load_model_weights(dist.unwrap(self.model), weights, where)
        self.task.optimizer.load_state_dict(state["optimizer"])
        for name, component in (("lr_scheduler", self.task.lr_scheduler), ("grad_scaler", self.scaler)):
            if component is not None and state[name] is not None:
                component.load_state_dict(state[name])
            elif (component is None) != (state[name] is None):
                log.warning("%s: %s is %s in the snapshot but %s in this run; it starts fresh", where, name,
                            "absent" if state[name] is None else "present", "absent" if component is None else "present")
        self.progress.load_state_dict(state["progress"])
        self.history.load_state_dict(state["history"])
        saved = state["env"]
        if saved["world_size"] == self.ctx.world_size:
            restore_rng(state["rng"][self.ctx.rank], self.ctx.device)
        else:
            # The data position re-shards exactly; per-rank random streams cannot, so they are
            # re-seeded from the step (the same on every restart with this world size).
            seed_rng(self.cfg.run.seed + self.ctx.rank + 1_000_003 * self.progress.global_step)
            log.warning(
                "%s was taken with world size %d, this run has %d: data position re-sharded from sample %d of epoch %d, "
                "global batch is now %d, RNG streams re-seeded (results will not be bitwise equal to an unbroken run)",
                where, saved["world_size"], self.ctx.world_size, self.progress.epoch_offset, self.progress.epoch,
                self.shard.samples_per_step,
            )
        if saved["num_threads"] != torch.get_num_threads():
            log.warning(
                "%s was taken with %d intra-op threads, this worker has %d: float results can differ in the last bits; "
                "set OMP_NUM_THREADS=%d for bitwise-identical resumes", where, saved["num_threads"],
                torch.get_num_threads(), saved["num_threads"],
            )
        log.info(
            "restored %s: step %d, epoch %d, sample %d of the epoch", where, self.progress.global_step,
            self.progress.epoch, self.progress.epoch_offset,
        )

    def _summarize(self, src: State, dst: State, step: int) -> None:
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
            wall_s=time.monotonic() - self._started,
        )
        log.info("%s", self.summary.line())


def _fmt(record: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in record.items())
