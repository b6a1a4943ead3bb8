"""How the micro-batches of one optimizer step become the same gradients on every rank.

The loop runs each micro-batch's forward and backward inside ``sync.micro_batch(index, count,
step)``, calls ``backward()`` on ``sync.scale(loss)``, and ``sync.finish(count)`` after the last one.
Two ways to do it:

- ``DDPAccumulation`` (the default): the model is wrapped in DDP; micro-batches but the last run
  under ``no_sync`` and accumulate into ``.grad``; the last backward's all-reduce averages over
  ranks. Fast, and bitwise on resume at an equal world size. At another world size the same
  samples are summed in another order (each rank's accumulation, then the ring all-reduce), and
  floating-point addition is not associative: the bits change.
- ``VirtualShards`` (``train.virtual_shards=N``, the bitwise-elastic mode): the global batch is N
  virtual shards of ``train.batch_size`` samples whatever the world size, and rank ``r`` of ``W``
  computes shards ``r, r + W, r + 2W, ...`` (the sampler's micro-batches). Each shard's forward
  starts from an RNG seeded by (run seed, step, shard), and its gradient is kept apart. The N
  gradients are then summed in one fixed binary tree, the same at every world size: shard ``v``'s
  bits from the highest down, a level per bit. The high bits are the micro-batch index, so a rank
  first adds its own shards pairwise (``j`` with ``j + L/2``, halving); the low bits are the rank,
  so the ranks finish the tree by recursive doubling, highest bit first: at each level a rank
  swaps its partial sum with partner ``r ^ bit`` and both compute lower + higher (IEEE addition of
  two numbers is commutative, so both hold the same bits). N and W must be powers of two. Every
  number then depends on the shard, never on the rank or the world size, so a run that shrinks and
  grows ends bitwise equal to an unbroken one (same machine type and intra-op thread count). The
  price: the exchanges come after the backward instead of overlapping it as DDP's all-reduce does
  (``benchmarks/step_overhead.py`` measures it). An ``all_gather`` of every shard's gradient and a
  sum in shard order was the first version: gloo's all_gather of 17 MB took 45 ms against 12 ms for
  an all-reduce of the same tensor, doubling the step of a 4 x Linear(1024) model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from elastictrain.core.config import Config
from elastictrain.core.errors import ConfigError
from elastictrain.core.rng import seed_rng
from elastictrain.dist import ddp
from elastictrain.dist import group as dist
from elastictrain.dist.sync_timer import GradientSyncTimer


class DDPAccumulation:
    """DDP's all-reduce at the last micro-batch; the loss of each is divided by their number."""

    def __init__(self, model: nn.Module, timer: GradientSyncTimer) -> None:
        self.model = model
        self.timer = timer

    def micro_batch(self, index: int, count: int, step: int) -> AbstractContextManager:
        return ddp.no_sync(self.model, skip_sync=index < count - 1)  # a plain context: this runs at every micro-batch

    def scale(self, loss: torch.Tensor, count: int) -> torch.Tensor:
        return loss if count == 1 else loss / count  # x / 1 is x exactly: no extra op and grad node per step

    def finish(self, count: int) -> None:
        self.timer.backward_done()  # the synchronising backward has returned: the all-reduce is done


class VirtualShards:
    """Per-shard RNG and gradients, summed over all shards in one fixed order on every rank."""

    def __init__(
        self, model: nn.Module, ctx: dist.DistContext, shards: int, seed: int, timer: GradientSyncTimer
    ) -> None:
        self.ctx = ctx
        self.shards = shards
        self.seed = seed
        self.timer = timer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self._rows: torch.Tensor | None = None  # [shards on this rank, numel]: each shard's gradient, flat
        self._received: torch.Tensor | None = None  # a partner's partial sum
        if ctx.distributed:
            # What DDP's constructor does: every rank starts from rank 0's weights and buffers.
            for tensor in [*model.parameters(), *model.buffers()]:
                torch_dist.broadcast(tensor.data, src=0)

    @contextmanager
    def micro_batch(self, index: int, count: int, step: int) -> Iterator[None]:
        shard = index * self.ctx.world_size + self.ctx.rank  # the sampler's layout: see data.ShardedBatchSampler
        seed_rng(shard_seed(self.seed, step, shard))
        yield
        row = self._rows_for(count)[index]
        offset = 0
        for param in self.params:
            size = param.numel()
            if param.grad is None:
                row[offset : offset + size].zero_()
            else:
                row[offset : offset + size].copy_(param.grad.reshape(-1))
                param.grad = None
            offset += size

    def scale(self, loss: torch.Tensor, count: int) -> torch.Tensor:
        return loss  # each shard's gradient is of its own mean loss; finish() divides the sum by the shards

    def finish(self, count: int) -> None:
        rows = self._rows_for(count)
        tree_sum_rows(rows)  # this rank's shards, pairwise: rows[0] holds their subtree's sum
        summed = rows[0]
        world, rank = self.ctx.world_size, self.ctx.rank
        if world > 1:
            started = time.perf_counter()
            if self._received is None:
                self._received = torch.empty_like(summed)
            bit = world // 2
            while bit:  # recursive doubling, the rank's highest bit first: the upper levels of the same tree
                partner = rank ^ bit
                exchange = [torch_dist.isend(summed, partner), torch_dist.irecv(self._received, partner)]
                for request in exchange:
                    assert request is not None  # None only on a rank outside the group
                    request.wait()
                if rank < partner:
                    summed.add_(self._received)  # lower + higher
                else:
                    summed.copy_(self._received.add_(summed))  # the same addition, lower + higher
                bit //= 2
            self.timer.waited(time.perf_counter() - started)
        summed.div_(world * count)
        offset = 0
        for param in self.params:
            size = param.numel()
            param.grad = summed[offset : offset + size].view_as(param)
            offset += size

    def _rows_for(self, count: int) -> torch.Tensor:
        if self._rows is None or self._rows.shape[0] != count:
            self._rows = torch.empty(count, self.numel, dtype=self.params[0].dtype, device=self.params[0].device)
        return self._rows


def tree_sum_rows(rows: torch.Tensor) -> None:
    """Sum the rows in place into ``rows[0]`` by halving: row ``i`` += row ``i + n/2`` until one is left."""
    count = rows.shape[0]
    while count > 1:
        count //= 2
        rows[:count] += rows[count : 2 * count]


def shard_seed(seed: int, step: int, shard: int) -> int:
    """The RNG seed of one virtual shard's forward in one step: the same whichever rank computes it."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + shard * 0x94D049BB133111EB) % 2**64
    return mixed >> 1  # torch.manual_seed takes up to 2**63


def make_gradient_sync(
    model: nn.Module, loss_fn: Any, ctx: dist.DistContext, cfg: Config, timer: GradientSyncTimer
) -> tuple[nn.Module, DDPAccumulation | VirtualShards]:
    """What the loop trains, a module whose ``forward(batch)`` is ``loss_fn(model, batch)`` (DDP-wrapped or
    not), and the gradient sync that goes with it."""
    shards = cfg.train.virtual_shards
    loss_forward = ddp.LossForward(model, loss_fn)
    if not shards:
        wrapped = ddp.wrap_model(loss_forward, ctx, cfg.dist)
        if cfg.stragglers.factor > 0:
            timer.register(wrapped)  # a no-op without DDP
        return wrapped, DDPAccumulation(wrapped, timer)
    check_virtual_shards(model)
    loss_forward.to(ctx.device)
    return loss_forward, VirtualShards(model, ctx, shards, cfg.run.seed, timer)


def wrap_model_for(
    model: nn.Module, loss_fn: Any, ctx: dist.DistContext, cfg: Config, timer: GradientSyncTimer
) -> tuple[nn.Module, DDPAccumulation | VirtualShards | None]:
    """``Session.wrap``: with a loss_fn, the module make_gradient_sync builds and its sync; without one, the plain
    DDP-wrapped model (a custom loop's own backward) and no sync, which the bitwise-elastic mode cannot do with."""
    if loss_fn is not None:
        return make_gradient_sync(model, loss_fn, ctx, cfg, timer)
    if cfg.train.virtual_shards:
        raise ConfigError(
            "train.virtual_shards needs the per-shard gradients of elastictrain's step runner: wrap with "
            "session.wrap(model, loss_fn) and train with elastictrain.StepRunner (or the Trainer), or set "
            "train.virtual_shards=0"
        )
    return ddp.wrap_model(model, ctx, cfg.dist), None


def check_virtual_shards(model: nn.Module) -> None:
    """One line for a model whose numbers would depend on how the batch is split."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("train.virtual_shards is set but the model has no trainable parameters")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    if len(dtypes) > 1:
        raise ConfigError(
            f"train.virtual_shards needs the trainable parameters in one dtype, the model has {', '.join(dtypes)}; "
            "cast the model to one dtype (autocast still works), or set train.virtual_shards=0"
        )
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            raise ConfigError(
                f"train.virtual_shards cannot keep {type(module).__name__} {name!r} bitwise: its running statistics "
                "are updated by every shard's forward on the rank that computes it, so they depend on the world size; "
                "use GroupNorm or LayerNorm, track_running_stats=False, or set train.virtual_shards=0"
            )
