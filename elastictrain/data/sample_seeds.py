"""Random augmentation that depends only on which sample is drawn.

A ``Dataset.__getitem__`` that draws from the global RNGs (``torch.randn`` jitter, ``random``,
``numpy.random``) would otherwise draw from whatever stream the process holds: a DataLoader
worker's stream restarts with every new iterator, and which worker fetches a sample depends on
the position the epoch started from, on ``num_workers`` and on the world size. So a run resumed
mid-epoch, or at another world size, would augment the same sample differently.

``SeededSamples`` wraps a map-style dataset: before each fetch it seeds torch's CPU generator,
``random`` and ``numpy.random`` from ``(seed, index)``, where the loader's seed already holds
``run.seed`` and the epoch. In a worker process those streams belong to the worker alone. In the
training process (``num_workers=0``) they also drive dropout and are saved in snapshots, so a
resume at the same world size is exact without seeding: there samples are seeded only where the
numbers must not depend on the rank that fetches them (``in_process``: the bitwise-elastic mode),
and the streams are put back after each batch. Saving them costs ~1 ms a batch of 32 here (numpy's
``get_state``/``set_state`` most of it), a quarter of the default job's step.

What it cannot reach: a generator the dataset keeps of its own (``torch.Generator``,
``numpy.random.default_rng``), which lives in each worker's copy of the dataset, and CUDA draws.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from elastictrain.core.rng import KeptCpuRng, seed_cpu_rng

log = logging.getLogger("elastictrain")

_MASK = (1 << 64) - 1
_GENERATORS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def _mix(value: int) -> int:
    """splitmix64's finalizer: neighbouring inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` under a loader seeded with ``seed``."""
    return _mix(_mix(seed & _MASK) ^ (index & _MASK))


class SeededSamples(Dataset):
    """``dataset`` with the global RNGs seeded from ``(seed, index)`` before each sample is fetched.

    The DataLoader fetches a batch at a time through ``__getitems__``: in the training process
    the streams are saved once per batch, not per sample (numpy's state alone costs more than the
    seeding). Samples are still fetched one by one, through the dataset's ``__getitem__``, even
    where it has a batched ``__getitems__``: a batch's draws would depend on the batch's
    composition, which changes with the world size and ``train.batch_size``.
    """

    def __init__(self, dataset: Dataset, seed: int, in_process: bool = True) -> None:
        self.dataset = dataset
        self.seed = seed
        self.in_process = in_process  # seed in the training process too (num_workers=0)

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))  # a map-style dataset's (torch's Dataset declares no __len__)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if get_worker_info() is not None:  # a worker process: its streams are its own
            return self._fetch(indices)
        if not self.in_process:  # the training process's streams, saved in every snapshot
            return [self.dataset[index] for index in indices]
        with KeptCpuRng():
            return self._fetch(indices)

    def _fetch(self, indices: list[int]) -> list[Any]:
        samples = []
        for index in indices:
            seed_cpu_rng(sample_seed(self.seed, index))
            samples.append(self.dataset[index])
        return samples


def own_generators(dataset: Any, name: str = "", depth: int = 3) -> list[str]:
    """Attributes of ``dataset`` (and of datasets it wraps) that hold a random generator of their own."""
    found = []
    for attribute, value in vars(dataset).items() if hasattr(dataset, "__dict__") else ():
        path = f"{name or type(dataset).__name__}.{attribute}"
        if isinstance(value, _GENERATORS):
            found.append(f"{path} ({type(value).__name__})")
        elif isinstance(value, Dataset) and depth > 1:
            found += own_generators(value, path, depth - 1)
    return found


def warn_own_generators(dataset: Dataset) -> None:
    """One line at start-up for random draws that seeding from the sample cannot reach."""
    found = own_generators(dataset)
    if found:
        log.warning(
            "train_data keeps a random generator of its own (%s): elastictrain seeds the global torch, random and "
            "numpy RNGs from each sample before fetching it, not that one, and does not save it, so its draws after a "
            "resume (or at another num_workers or world size) differ from an unbroken run's; draw from the global "
            "RNGs in __getitem__ (torch.randn, random, numpy.random), or seed it there from the sample index",
            ", ".join(found),
        )
