"""Resumable sharded sampling: exact sample lists, resume at any step, re-sharding over world sizes."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
from torch.utils.data import TensorDataset

from elastictrain.data.sampling import EvalBatchSampler, Shard, ShardedBatchSampler, make_loader, steps_in_epoch
from elastictrain.data.sample_seeds import own_generators, warn_own_generators


def global_steps(num_samples, world_size, batch_size, accum, seed, epoch, offset):
    """The samples of each optimizer step over all ranks (rank order inside a micro-batch)."""
    per_rank = [
        list(ShardedBatchSampler(num_samples, Shard(rank, world_size, batch_size, accum), seed, epoch, offset, True))
        for rank in range(world_size)
    ]
    micro_batches = [sum((per_rank[r][m] for r in range(world_size)), []) for m in range(len(per_rank[0]))]
    return [sum(micro_batches[s : s + accum], []) for s in range(0, len(micro_batches), accum)]


def test_an_epoch_covers_each_sample_once_and_drops_only_the_incomplete_last_step():
    steps = global_steps(100, world_size=3, batch_size=4, accum=2, seed=0, epoch=0, offset=0)
    flat = [i for step in steps for i in step]
    assert len(steps) == steps_in_epoch(100, Shard(0, 3, 4, 2)) == 4  # 100 // 24
    assert len(flat) == len(set(flat)) == 96
    assert set(flat) <= set(range(100))


def test_order_is_a_function_of_seed_and_epoch_only():
    a = global_steps(64, 2, 4, 1, seed=5, epoch=3, offset=0)
    assert a == global_steps(64, 2, 4, 1, seed=5, epoch=3, offset=0)
    assert a != global_steps(64, 2, 4, 1, seed=5, epoch=4, offset=0)
    assert a != global_steps(64, 2, 4, 1, seed=6, epoch=3, offset=0)


def test_resume_at_a_step_boundary_continues_the_same_sequence():
    unbroken = global_steps(200, 2, 8, 1, seed=1, epoch=2, offset=0)
    resumed = global_steps(200, 2, 8, 1, seed=1, epoch=2, offset=5 * 16)
    assert resumed == unbroken[5:]


def test_reshard_to_another_world_size_skips_and_repeats_nothing():
    n, seed, epoch = 240, 3, 1
    before = global_steps(n, 2, 8, 1, seed, epoch, 0)[:4]  # 4 steps of 16 samples at world size 2
    for new_world in (1, 3):
        after = global_steps(n, new_world, 8, 1, seed, epoch, offset=64)
        seen = [i for step in before + after for i in step]
        assert len(seen) == len(set(seen)), f"a sample repeated after 2 -> {new_world}"
        whole = [i for step in global_steps(n, 1, 8, 1, seed, epoch, 0) for i in step]
        assert seen == whole[: len(seen)], "the global order changed across the world-size change"


def test_eval_sampler_covers_every_sample_once_with_uneven_shards():
    shards = [list(EvalBatchSampler(10, rank, 3, batch_size=2)) for rank in range(3)]
    flat = sorted(i for shard in shards for batch in shard for i in batch)
    assert flat == list(range(10))
    assert [sum(map(len, s)) for s in shards] == [4, 3, 3]


def test_iterating_a_loader_leaves_the_global_rng_alone():
    data = TensorDataset(torch.arange(32.0))
    sampler = ShardedBatchSampler(32, Shard(0, 1, 4), seed=0, epoch=0, offset=0, shuffle=True)
    before = torch.get_rng_state()
    batches = [b[0].tolist() for b in make_loader(data, sampler, num_workers=0, seed=0)]
    assert torch.equal(before, torch.get_rng_state()), "a DataLoader iterator consumed the global RNG"
    assert len(batches) == 8


class Augmented(torch.utils.data.Dataset):
    """Each sample drawn with jitter from all three global RNGs a user's augmentation may use."""

    def __len__(self):
        return 48

    def __getitem__(self, index):
        jitter = torch.randn(()) + random.random() + float(np.random.rand())
        return torch.tensor([float(index), float(jitter)])


def augmented_samples(num_workers, world_size, offset, epoch=0):
    """index -> the augmented sample each rank's loader gave, from ``offset`` global samples on."""
    samples = {}
    for rank in range(world_size):
        sampler = ShardedBatchSampler(48, Shard(rank, world_size, 4), seed=7, epoch=epoch, offset=offset, shuffle=True)
        for batch in make_loader(Augmented(), sampler, num_workers=num_workers, seed=7 + epoch):
            samples.update({int(row[0]): float(row[1]) for row in batch})
    return samples


def test_random_augmentation_depends_on_the_sample_only_not_on_worker_resume_point_or_world_size():
    unbroken = augmented_samples(num_workers=2, world_size=1, offset=0)
    assert len(unbroken) == 48 and len(set(unbroken.values())) == 48
    # A resume mid-epoch starts new workers at another batch: every sample still gets its own numbers.
    for num_workers, world_size, offset in [(2, 1, 20), (2, 1, 12), (0, 1, 20), (2, 2, 16), (0, 4, 16)]:
        resumed = augmented_samples(num_workers, world_size, offset)
        assert resumed and resumed == {i: unbroken[i] for i in resumed}, (num_workers, world_size, offset)
    # Another epoch draws other numbers for the same sample.
    assert set(augmented_samples(0, 1, 0, epoch=1).values()).isdisjoint(unbroken.values())


def test_seeding_samples_in_the_training_process_leaves_its_rngs_where_they_were():
    """num_workers=0: the global streams also drive dropout and are saved in snapshots."""
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = torch.rand(()), random.random(), np.random.rand()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    augmented_samples(num_workers=0, world_size=1, offset=0)
    assert (torch.rand(()), random.random(), np.random.rand()) == expected


class OwnGenerator(torch.utils.data.Dataset):
    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.randn((), generator=self.generator)


def test_a_dataset_with_a_generator_of_its_own_is_named_at_start_up_and_plain_ones_are_not(caplog):
    wrapped = torch.utils.data.Subset(OwnGenerator(), [0, 1])
    assert own_generators(wrapped) == ["Subset.dataset.generator (Generator)"]
    assert own_generators(TensorDataset(torch.zeros(4))) == own_generators(Augmented()) == []
    logger = logging.getLogger("elastictrain")
    extra = [] if logger.propagate else [caplog.handler]  # the package's logger stops propagating once set up
    for handler in extra:
        logger.addHandler(handler)
    try:
        warn_own_generators(wrapped)
    finally:
        for handler in extra:
            logger.removeHandler(handler)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert "train_data keeps a random generator of its own (Subset.dataset.generator (Generator))" in record.getMessage()


def test_outside_the_bitwise_elastic_mode_the_training_process_draws_from_its_own_streams():
    # At num_workers=0 the training process's streams are in every snapshot: no per-batch save and seed.
    sampler = ShardedBatchSampler(48, Shard(0, 1, 4), seed=7, epoch=0, offset=0, shuffle=True)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    first = [batch for batch in make_loader(Augmented(), sampler, num_workers=0, seed=7, seed_in_process=False)]
    torch.manual_seed(4), random.seed(4), np.random.seed(4)
    second = [batch for batch in make_loader(Augmented(), sampler, num_workers=0, seed=7, seed_in_process=False)]
    assert not torch.equal(torch.cat(first), torch.cat(second))  # the process's streams drove the jitter
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    again = [batch for batch in make_loader(Augmented(), sampler, num_workers=0, seed=7, seed_in_process=False)]
    assert torch.equal(torch.cat(first), torch.cat(again))
