"""Resumable sharded sampling: exact sample lists, resume at any step, re-sharding over world sizes."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from elastictrain.data import EvalBatchSampler, Shard, ShardedBatchSampler, make_loader, steps_in_epoch


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
