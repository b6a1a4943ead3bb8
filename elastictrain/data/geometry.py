"""The batch geometry of a run, and what becomes of it when a restart brings another world size.

An optimizer step takes ``train.batch_size x world size x accumulation`` samples: the global batch.
When an elastic job shrinks or grows, ``train.on_world_size_change`` says what gives:

- ``keep_global_batch`` (default): the accumulation changes so that the global batch stays the one
  the run started with. Every step then takes the same samples as at full size (the data position
  counts global samples), the number of steps and so the LR schedule stay as planned. A world size
  whose ranks cannot split the global batch evenly is a ConfigError naming the sizes that can.
- ``keep_rank_batch``: batch size and accumulation stay as configured and the global batch follows
  the world size: the steps get fewer or more. With ``train.scale_lr=true`` the learning rate is
  scaled by the ratio of the new global batch to the old (the linear scaling rule).

``BatchGeometry`` is the Stateful that carries the global batch and accumulation through snapshots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from elastictrain.core.config import TrainConfig
from elastictrain.core.errors import ConfigError
from elastictrain.data.sampling import Shard

log = logging.getLogger("elastictrain")


@dataclass
class BatchGeometry:
    """What the snapshot's steps were taken with; None until the run's first start sets it."""

    global_batch: int | None = None  # samples per optimizer step
    grad_accum_steps: int | None = None  # micro-batches per step on each rank
    # train.batch_size and train.grad_accum_steps as configured then: another value now is a
    # change the user made on purpose (snapshot.accept_changes), and the config wins.
    configured: tuple[int, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "grad_accum_steps": self.grad_accum_steps,
            "configured": list(self.configured) if self.configured else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.global_batch = int(state_dict["global_batch"])
        self.grad_accum_steps = int(state_dict["grad_accum_steps"])
        batch_size, grad_accum_steps = state_dict["configured"]
        self.configured = (int(batch_size), int(grad_accum_steps))


@dataclass(frozen=True)
class Fit:
    """The geometry for this world size, decided from the snapshot's and the policy."""

    grad_accum_steps: int
    global_batch: int
    lr_factor: float = 1.0
    message: str | None = None  # one log line when a world-size change changed anything


def fit_to_world(train: TrainConfig, world_size: int, saved: BatchGeometry, saved_world_size: int | None) -> Fit:
    """The accumulation and global batch at ``world_size`` (pure: no state is touched).

    A fresh start passes an empty ``BatchGeometry()`` and gets the configured geometry.
    """
    if train.virtual_shards:
        return _fit_virtual_shards(train, world_size, saved, saved_world_size)
    per_rank_step = train.batch_size * world_size
    configured = Fit(train.grad_accum_steps, per_rank_step * train.grad_accum_steps)
    if saved.global_batch is None or saved.configured != (train.batch_size, train.grad_accum_steps):
        return configured  # a fresh start, or a batch config changed on purpose
    change = f"world size {saved_world_size} -> {world_size}"
    world_changed = saved_world_size != world_size
    if train.on_world_size_change == "keep_rank_batch":
        if not world_changed:
            return configured
        factor = configured.global_batch / saved.global_batch if train.scale_lr else 1.0
        lr = f"learning rate x {factor:.6g} (train.scale_lr)" if train.scale_lr else "learning rate unchanged"
        return Fit(
            configured.grad_accum_steps,
            configured.global_batch,
            factor,
            f"{change}: global batch {saved.global_batch} -> {configured.global_batch} samples per step, "
            f"train.batch_size {train.batch_size} per rank kept (train.on_world_size_change=keep_rank_batch); {lr}",
        )
    if saved.global_batch % per_rank_step:
        ranks = saved.global_batch // train.batch_size
        raise ConfigError(
            f"{change}: the global batch of {saved.global_batch} samples per step cannot be kept "
            f"(train.on_world_size_change=keep_global_batch): it is not a multiple of train.batch_size "
            f"{train.batch_size} x {world_size} ranks; world sizes that can keep it: {_divisors(ranks)} (set --nnodes "
            "and --nproc-per-node to stay among them), or set train.on_world_size_change=keep_rank_batch"
        )
    accum = saved.global_batch // per_rank_step
    if not world_changed:
        return Fit(accum, saved.global_batch)
    return Fit(
        accum,
        saved.global_batch,
        1.0,
        f"{change}: global batch of {saved.global_batch} samples per step kept "
        f"(train.on_world_size_change=keep_global_batch): gradient accumulation {saved.grad_accum_steps} -> {accum} "
        f"micro-batches of train.batch_size {train.batch_size} per rank",
    )


def _fit_virtual_shards(train: TrainConfig, world_size: int, saved: BatchGeometry, saved_world_size: int | None) -> Fit:
    """The bitwise-elastic mode: always ``virtual_shards x batch_size`` samples, an equal count of shards per rank."""
    shards = train.virtual_shards
    if shards % world_size:
        raise ConfigError(
            f"world size {world_size}: train.virtual_shards={shards} cannot be split evenly over {world_size} ranks "
            f"(the bitwise-elastic mode gives every rank the same number of shards); world sizes that can: "
            f"{_divisors(shards)} (set --nnodes and --nproc-per-node to stay among them), or set train.virtual_shards "
            "to a multiple of every world size the job may have"
        )
    fit = Fit(shards // world_size, shards * train.batch_size)
    if saved.global_batch is None or saved_world_size in (None, world_size):
        return fit
    return Fit(
        fit.grad_accum_steps,
        fit.global_batch,
        1.0,
        f"world size {saved_world_size} -> {world_size}: {shards} virtual shards of train.batch_size "
        f"{train.batch_size} kept (train.virtual_shards), {fit.grad_accum_steps} per rank; the numbers stay bitwise",
    )


def planned_steps(
    num_samples: int,
    global_batch: int,
    max_epochs: int,
    max_steps: int | None,
    global_step: int = 0,
    epoch: int = 0,
    epoch_offset: int = 0,
) -> int:
    """Optimizer steps of the whole run: those done, plus those left at ``global_batch`` samples a step.

    The position (``global_step``, ``epoch``, ``epoch_offset`` in global samples) is where the run
    stands; with the global batch it started with, the answer is the plan of its first start.
    """
    left = 0
    if epoch < max_epochs:
        left = (num_samples - epoch_offset) // global_batch + (max_epochs - epoch - 1) * (num_samples // global_batch)
    total = global_step + max(left, 0)
    return min(total, max_steps) if max_steps else total


def run_steps(train: TrainConfig, samples: int | None, world_size: int, global_batch: int | None, progress: Any) -> int:
    """Optimizer steps of the whole run: those done plus those left at its global batch (before the first
    restore: a fresh start's at this world size). A stream, or a loop without data, runs train.max_steps."""
    if samples is None:
        return train.max_steps or 0
    if global_batch is None:
        global_batch = fit_to_world(train, world_size, BatchGeometry(), None).global_batch
    p = progress
    return planned_steps(
        samples, global_batch, train.max_epochs, train.max_steps, p.global_step, p.epoch, p.epoch_offset
    )


def scheduler_steps(train: TrainConfig, total_steps: int) -> int:
    """How often ``lr_scheduler.step()`` is called in the run: per step, or per epoch (train.lr_scheduler_interval)."""
    return total_steps if train.lr_scheduler_interval == "step" else train.max_epochs


def apply_fit(
    fit: Fit, geometry: BatchGeometry, rank: int, world_size: int, train: TrainConfig, optimizers: list[tuple[Any, Any]]
) -> Shard:
    """Record ``fit`` in the geometry, scale the learning rate of each (optimizer, scheduler) if it says so,
    and return this rank's shard."""
    geometry.global_batch, geometry.grad_accum_steps = fit.global_batch, fit.grad_accum_steps
    geometry.configured = (train.batch_size, train.grad_accum_steps)
    if fit.lr_factor != 1.0:
        for optimizer, lr_scheduler in optimizers:
            scale_learning_rate(optimizer, lr_scheduler, fit.lr_factor)
    if fit.message is not None:
        log.info("%s", fit.message)
    return Shard(rank, world_size, train.batch_size, fit.grad_accum_steps)


def scale_learning_rate(optimizer: Any, lr_scheduler: Any, factor: float) -> None:
    """Multiply the learning rate by ``factor`` where it lives: each param group and the scheduler's base."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
        lr_scheduler.base_lrs = [lr * factor for lr in lr_scheduler.base_lrs]


def _divisors(number: int, shown: int = 8) -> str:
    found = [str(d) for d in range(1, number + 1) if number % d == 0]
    return ", ".join(found[:shown]) + (", ..." if len(found) > shown else "")
