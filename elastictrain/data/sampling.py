"""Resumable sharded sampling, counted in global samples so a position survives a new world size.

An epoch is one permutation of the dataset, fixed by (seed, epoch). It is cut into optimizer
steps of ``batch_size * world_size * grad_accum_steps`` consecutive samples (a last, incomplete
step is dropped); inside a step, micro-batch ``m`` is the next ``batch_size * world_size``
samples and rank ``r`` takes its ``r``-th slice. The position inside an epoch is the number of
global samples already consumed, so resuming at any step boundary — with the same or another
world size — continues the same sequence with nothing skipped and nothing repeated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from elastictrain.core.errors import ConfigError, UsageError
from elastictrain.data.sample_seeds import SeededSamples


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int
    batch_size: int  # per rank, per micro-batch
    grad_accum_steps: int = 1

    @property
    def samples_per_micro_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def samples_per_step(self) -> int:
        return self.samples_per_micro_batch * self.grad_accum_steps


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The global order of sample indices for one epoch; identical on every rank and every restart."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def steps_in_epoch(num_samples: int, shard: Shard, offset: int = 0) -> int:
    """Whole optimizer steps left in an epoch from a global sample offset."""
    return max(num_samples - offset, 0) // shard.samples_per_step


class ShardedBatchSampler:
    """This rank's micro-batches for one epoch from ``offset`` global samples on (a DataLoader batch_sampler)."""

    def __init__(
        self,
        num_samples: int,
        shard: Shard,
        seed: int,
        epoch: int,
        offset: int,
        shuffle: bool,
        skip: AbstractSet[int] = frozenset(),
    ) -> None:
        self.order = epoch_order(num_samples, seed, epoch, shuffle)
        if skip:  # the anomaly skip list (anomalies.py): left out of every epoch, the rest keeps its order
            self.order = [index for index in self.order if index not in skip]
        self.shard = shard
        self.offset = offset
        self.steps = steps_in_epoch(len(self.order), shard, offset)

    def __len__(self) -> int:
        return self.steps * self.shard.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        micro = self.shard.samples_per_micro_batch
        first = self.shard.rank * self.shard.batch_size
        for start in range(self.offset, self.offset + len(self) * micro, micro):
            yield self.order[start + first : start + first + self.shard.batch_size]


class EvalBatchSampler:
    """Every sample exactly once over all ranks (rank r takes r, r+W, ...); shards may be uneven."""

    def __init__(self, num_samples: int, rank: int, world_size: int, batch_size: int) -> None:
        self.indices = list(range(rank, num_samples, world_size))
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, len(self.indices), self.batch_size):
            yield self.indices[start : start + self.batch_size]


def make_loader(
    dataset: Dataset,
    batch_sampler: Any,
    num_workers: int,
    seed: int,
    collate_fn: Any = None,
    seed_in_process: bool = True,
) -> DataLoader:
    # A DataLoader iterator draws its worker base seed from the *global* torch RNG unless it has
    # a generator of its own; a resumed run creates its iterator at another point of that stream,
    # so without this the dropout masks after a restore would differ from an unbroken run.
    generator = torch.Generator().manual_seed(seed)
    # Each sample's random augmentation is seeded from (seed, index), so it is the same whichever
    # process fetches it: after a mid-epoch resume, at any num_workers and any world size. At
    # num_workers=0 only with ``seed_in_process`` (the training process's streams are in snapshots).
    return DataLoader(
        SeededSamples(dataset, seed, in_process=seed_in_process),
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        generator=generator,
        persistent_workers=False,
    )


# Streams -------------------------------------------------------------------------------------
#
# An IterableDataset has no indices to permute: each rank reads its own share of a stream. Exact
# resume then needs the stream's own position, which follows the ecosystem's convention
# (torchdata's StatefulDataLoader, Hugging Face datasets): the dataset has ``state_dict()`` and
# ``load_state_dict()``, saved per rank in the snapshot. ``set_epoch(epoch)``, if present, is
# called at every epoch start (as for a DistributedSampler). Shards of a stream can be uneven: an
# epoch ends for every rank as soon as one rank's share is exhausted (agreed in one small
# all_reduce per step), so no rank waits in a collective for a batch that will never come.


def samples_in(dataset: Dataset) -> int:
    """A map-style dataset's length: torch's Dataset declares no ``__len__``; check_dataset requires one."""
    return len(cast(Sized, dataset))


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def check_stream(dataset: Any, num_workers: int, max_steps: int | None) -> None:
    """One clear line for a stream that cannot be resumed exactly."""
    name = type(dataset).__name__
    missing = [method for method in ("state_dict", "load_state_dict") if not callable(getattr(dataset, method, None))]
    if missing:
        raise ConfigError(
            f"train_data is an IterableDataset ({name}) without {' and '.join(f'{m}()' for m in missing)}: its position "
            "cannot be saved, so a restart could not continue where it stopped; give it state_dict()/load_state_dict() "
            "returning and taking its position (see docs/guides/trainer.md, 'Streaming data'), or use a map-style Dataset"
        )
    if num_workers > 0:
        raise ConfigError(
            f"train_data is an IterableDataset ({name}) and data.num_workers={num_workers}: its position would live in "
            "the worker processes and could not be saved; set data.num_workers=0 (or make it a map-style Dataset)"
        )
    if max_steps is None:
        raise ConfigError(
            f"train_data is an IterableDataset ({name}) with no length, so the run's length must be given: "
            "set train.max_steps (train.max_epochs still ends the run after that many passes over the stream)"
        )


def make_stream_loader(dataset: Dataset, batch_size: int, epoch: int, seed: int, collate_fn: Any = None) -> DataLoader:
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    # num_workers=0: the dataset's position is exactly the samples handed to training, so a
    # snapshot between steps holds the true position. A generator of its own, as in make_loader,
    # keeps the iterator from drawing from the global RNG (which a resumed run is elsewhere in).
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=0,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(seed),
    )


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}; batches must hold tensors")


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch  # the DataLoader made CPU tensors: walking the batch would cost dispatcher time per step
    return _to_device(batch, device)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def check_dataset(dataset: Any, what: str) -> None:
    """A DataLoader (or nothing) where a Dataset belongs is one line naming the fix, not a traceback a step in."""
    if isinstance(dataset, DataLoader):
        raise UsageError(
            f"{what} is a DataLoader; pass the Dataset it loads (its .dataset): elastictrain builds the loader itself, "
            "sharded across ranks and resumable mid-epoch (batch size: train.batch_size; a collate_fn: pass it too)"
        )
    if not is_stream(dataset) and hasattr(dataset, "__len__") and len(dataset) == 0:
        raise UsageError(f"{what} is empty: its Dataset has 0 samples; check what it reads (a path, a filter, a split)")
