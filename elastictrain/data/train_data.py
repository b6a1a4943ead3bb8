"""The training set's position, sharded: each step's micro-batches, from where the run is.

``Session.loader(dataset)`` returns one. Iterated, it yields this rank's micro-batches of the
current epoch from the restored position (``progress.epoch`` and ``epoch_offset``, counted in
global samples), ``grad_accum_steps`` of them per optimizer step, on the session's device. The
order is a function of (run.seed, epoch) and the position alone, so a restart at any world size
continues with the samples an unbroken run would have seen next (``data.ShardedBatchSampler``).
A stream (``IterableDataset``) is read in per-rank shares whose positions travel in snapshots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.utils.data import Dataset

from elastictrain.core.config import Config
from elastictrain.core.errors import ConfigError, UsageError
from elastictrain.core.progress import Progress
from elastictrain.data.sample_seeds import warn_own_generators
from elastictrain.data.sampling import (
    Shard,
    ShardedBatchSampler,
    batch_size_of,
    check_dataset,
    check_stream,
    is_stream,
    make_loader,
    make_stream_loader,
    samples_in,
    steps_in_epoch,
    to_device,
)
from elastictrain.dist import collectives
from elastictrain.dist import group as dist

_UNTIL_EXHAUSTED = 2**62  # a stream's epoch has no step count: it ends when the stream does


class TrainData:
    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable | None,
        cfg: Config,
        ctx: dist.DistContext,
        progress: Progress,
        shard: Shard,
        on_end_without_step: Callable[[], None],
        skipped: AbstractSet[int] = frozenset(),
    ) -> None:
        check_dataset(dataset, "the dataset given to session.loader()")
        self.dataset, self.collate_fn, self.cfg, self.ctx, self.progress = dataset, collate_fn, cfg, ctx, progress
        self.shard = shard
        self.skipped = skipped  # global sample indices left out of every epoch (the anomaly log's, updated in place)
        self._order: list[int] = []  # the epoch's global order, as the sampler reads it
        self.stream = is_stream(dataset)
        self.samples = None if self.stream else samples_in(dataset)
        self._on_end_without_step = on_end_without_step  # the session ends the epoch then
        self._batches: Iterator | None = None
        self.steps_left = 0
        self.taken: list[int] = []  # the sample counts of the micro-batches handed out since the last step
        train = cfg.train
        if self.stream:
            check_stream(dataset, cfg.data.num_workers, train.max_steps)
            if train.virtual_shards:
                raise ConfigError(
                    f"train.virtual_shards needs a map-style Dataset: a stream ({type(dataset).__name__}) is "
                    "read in per-rank shares that cannot be cut into the same virtual shards at another world size; "
                    "set train.virtual_shards=0"
                )
            return
        if ctx.is_main:
            warn_own_generators(dataset)
        if steps_in_epoch(samples_in(dataset), shard) == 0:
            raise ConfigError(
                f"the training set has {samples_in(dataset)} samples, fewer than one optimizer step takes "
                f"({shard.samples_per_step} = train.batch_size x world size x train.grad_accum_steps); lower train.batch_size"
            )

    @property
    def rank_statefuls(self) -> dict[str, Any]:
        """A stream's position differs per rank: one entry per rank in the snapshot."""
        return {"train_data": self.dataset} if self.stream else {}

    @property
    def epoch_ended(self) -> bool:
        return self._batches is not None and self.steps_left == 0

    def end_epoch(self) -> None:
        self._batches = None

    def steps(self, finished: Callable[[], bool]) -> Iterator[list[Any]]:
        """The micro-batches of each remaining step of this epoch, until the epoch or the run ends."""
        if finished():
            return
        if self._batches is None:
            self._open_epoch()
        if self.steps_left == 0:  # after a restore into a larger world, the rest of an epoch can be under one step
            self._on_end_without_step()
            return
        try:
            yield from self._steps(finished)
        except GeneratorExit:  # the loop was left mid-epoch: the next one reopens it at the run's position
            self._batches, self.taken = None, []
            raise

    def _steps(self, finished: Callable[[], bool]) -> Iterator[list[Any]]:
        while self.steps_left > 0 and not finished():
            if self.taken:  # before the next batches, whose reading a stream agrees on in a collective
                raise UsageError(
                    f"rank {self.ctx.rank} asked the loader for the next step's micro-batches without session.step() "
                    f"after the {len(self.taken)} it took: call session.step() on every rank, once per optimizer step "
                    "(a rank that skips it leaves the others waiting in a collective)"
                )
            batches = self._next_batches()
            if batches is None:  # a stream's epoch ended on some rank: every rank ends it here
                self.steps_left = 0
                self._on_end_without_step()
                return
            self.steps_left -= 1
            yield [to_device(b, self.ctx.device) for b in batches]

    def reopen(self) -> None:
        """After a rollback restored the position: the same loop goes on from there (the epoch reopened)."""
        self._batches, self.taken, self.steps_left = None, [], 0
        self._open_epoch()

    def step_samples(self) -> list[int] | None:
        """The global sample indices of the step being taken (before the position moves on); None for a stream."""
        if self.stream:
            return None
        start = self.progress.epoch_offset
        return self._order[start : start + self.shard.samples_per_step]

    def take(self) -> list[int]:
        taken, self.taken = self.taken, []
        return taken

    def _open_epoch(self) -> None:
        epoch, seed = self.progress.epoch, self.cfg.run.seed + self.progress.epoch
        if self.stream:
            loader = make_stream_loader(self.dataset, self.cfg.train.batch_size, epoch, seed, self.collate_fn)
            self._batches, self.steps_left = iter(loader), _UNTIL_EXHAUSTED
            return
        sampler = ShardedBatchSampler(
            samples_in(self.dataset),
            self.shard,
            self.cfg.run.seed,
            epoch,
            self.progress.epoch_offset,
            self.cfg.data.shuffle,
            self.skipped,
        )
        self._order = sampler.order
        loader = make_loader(
            self.dataset,
            sampler,
            self.cfg.data.num_workers,
            seed,
            self.collate_fn,
            seed_in_process=self.cfg.train.virtual_shards > 0,
        )  # the same numbers whichever rank fetches a sample
        self._batches = iter(loader)
        self.steps_left = sampler.steps

    def _next_batches(self) -> list[Any] | None:
        """The micro-batches of the next step; None when a stream's epoch ended (on any rank: all agree)."""
        accum = self.shard.grad_accum_steps
        assert self._batches is not None  # _open_epoch ran
        if not self.stream:
            return [next(self._batches) for _ in range(accum)]
        batches = list(itertools.islice(self._batches, accum))
        # A short or missing batch ends the epoch, as an incomplete step does for map-style data.
        ended = len(batches) < accum or any(batch_size_of(b) < self.cfg.train.batch_size for b in batches)
        if self.ctx.distributed:
            ended = collectives.all_reduce_sum(torch.tensor([float(ended)], dtype=torch.float64), self.ctx).item() > 0
        return None if ended else batches


def wrong_micro_batches(taken: int, per_step: int, configured: int) -> UsageError:
    """``session.step()`` after another number of micro-batches than a step takes; names the elastic policy when it,
    not train.grad_accum_steps, chose the number (a snapshot of a larger world resumed here)."""
    why = (
        ""
        if per_step == configured
        else (
            f"; {per_step}, not train.grad_accum_steps={configured}, because the snapshot's global batch is kept at this "
            "world size (train.on_world_size_change=keep_global_batch): iterate loader.steps() (each step's micro-batches "
            "as one list), or set train.on_world_size_change=keep_rank_batch"
        )
    )
    return UsageError(
        f"session.step() after {taken} micro-batch(es) of the loader; a step takes {per_step} "
        f"(session.grad_accum_steps): call step() once per optimizer step{why}"
    )


class Loader:
    """What ``Session.loader`` returns: iterate it for this epoch's micro-batches (one at a time)."""

    def __init__(self, data: TrainData, finished: Callable[[], bool]) -> None:
        self._data, self._finished = data, finished

    def __iter__(self) -> Iterator[Any]:
        for batches in self._data.steps(self._finished):
            for batch in batches:
                self._data.taken.append(batch_size_of(batch))  # the session checks a step took grad_accum_steps
                yield batch

    def steps(self) -> Iterator[list[Any]]:
        """Each step's micro-batches as one list (``train.grad_accum_steps`` of them)."""
        for batches in self._data.steps(self._finished):
            self._data.taken.extend(batch_size_of(batch) for batch in batches)
            yield batches
