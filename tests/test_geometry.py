"""The batch policy on a world-size change (elastictrain/data/geometry.py), as tables: no processes."""

from __future__ import annotations

import pytest
import torch

from elastictrain.core.config import TrainConfig
from elastictrain.core.errors import ConfigError
from elastictrain.data.geometry import BatchGeometry, Fit, fit_to_world, planned_steps, scale_learning_rate

KEEP_GLOBAL = TrainConfig(batch_size=16)
KEEP_RANK = TrainConfig(batch_size=16, on_world_size_change="keep_rank_batch")
KEEP_RANK_SCALED = TrainConfig(batch_size=16, on_world_size_change="keep_rank_batch", scale_lr=True)


def saved(global_batch, accum, configured=(16, 1)):
    return BatchGeometry(global_batch, accum, configured)


@pytest.mark.parametrize("train, world, geometry, saved_world, expected", [
    # A fresh start (nothing saved) and an older snapshot without a geometry: as configured.
    (KEEP_GLOBAL, 2, BatchGeometry(), None, Fit(1, 32)),
    (KEEP_GLOBAL, 3, BatchGeometry(), 2, Fit(1, 48)),
    # Shrink 2 -> 1 and grow back: the accumulation carries the global batch of 32.
    (KEEP_GLOBAL, 1, saved(32, 1), 2, Fit(2, 32, 1.0, "world size 2 -> 1: global batch of 32 samples per step kept "
                                           "(train.on_world_size_change=keep_global_batch): gradient accumulation 1 -> 2 "
                                           "micro-batches of train.batch_size 16 per rank")),
    (KEEP_GLOBAL, 2, saved(32, 2), 1, Fit(1, 32, 1.0, "world size 1 -> 2: global batch of 32 samples per step kept "
                                           "(train.on_world_size_change=keep_global_batch): gradient accumulation 2 -> 1 "
                                           "micro-batches of train.batch_size 16 per rank")),
    # A restart at the smaller world keeps its accumulation, and says nothing.
    (KEEP_GLOBAL, 1, saved(32, 2), 1, Fit(2, 32)),
    (TrainConfig(batch_size=16, grad_accum_steps=4), 4, saved(128, 4, (16, 4)), 2,
     Fit(2, 128, 1.0, "world size 2 -> 4: global batch of 128 samples per step kept (train.on_world_size_change="
                      "keep_global_batch): gradient accumulation 4 -> 2 micro-batches of train.batch_size 16 per rank")),
    # train.batch_size changed on purpose since the snapshot (snapshot.accept_changes): the config wins.
    (KEEP_GLOBAL, 1, saved(32, 2, (8, 1)), 2, Fit(1, 16)),
    # keep_rank_batch: the global batch follows the world size; the LR only with train.scale_lr.
    (KEEP_RANK, 1, saved(32, 1), 2, Fit(1, 16, 1.0, "world size 2 -> 1: global batch 32 -> 16 samples per step, "
                                        "train.batch_size 16 per rank kept (train.on_world_size_change=keep_rank_batch); "
                                        "learning rate unchanged")),
    (KEEP_RANK_SCALED, 4, saved(16, 1), 1, Fit(1, 64, 4.0, "world size 1 -> 4: global batch 16 -> 64 samples per step, "
                                               "train.batch_size 16 per rank kept (train.on_world_size_change="
                                               "keep_rank_batch); learning rate x 4 (train.scale_lr)")),
    (KEEP_RANK, 1, saved(32, 2), 1, Fit(1, 16)),  # switched from keep_global_batch, same world: as configured
], ids=["fresh", "older-snapshot", "shrink", "grow-back", "restart-shrunk", "grow-with-accum", "batch-changed",
        "rank-shrink", "rank-grow-scaled", "rank-same-world"])
def test_fit_to_world(train, world, geometry, saved_world, expected):
    assert fit_to_world(train, world, geometry, saved_world) == expected


@pytest.mark.parametrize("world, sizes", [(3, "1, 2, 4"), (8, "1, 2, 4")])
def test_a_global_batch_the_ranks_cannot_split_is_one_config_error_naming_the_sizes_that_can(world, sizes):
    with pytest.raises(ConfigError) as raised:
        fit_to_world(KEEP_GLOBAL, world, saved(64, 2), 2)
    message = str(raised.value)
    assert message == (f"world size 2 -> {world}: the global batch of 64 samples per step cannot be kept "
                       f"(train.on_world_size_change=keep_global_batch): it is not a multiple of train.batch_size 16 x "
                       f"{world} ranks; world sizes that can keep it: {sizes} (set --nnodes and --nproc-per-node to "
                       "stay among them), or set train.on_world_size_change=keep_rank_batch")


def test_scaling_the_learning_rate_scales_the_schedule_that_follows():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    before = optimizer.param_groups[0]["lr"]
    scale_learning_rate(optimizer, scheduler, 2.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * before)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * 0.1 / 5)


def test_the_geometry_is_a_stateful():
    restored = BatchGeometry()
    restored.load_state_dict(saved(64, 2, (16, 1)).state_dict())
    assert restored == saved(64, 2, (16, 1))


VIRTUAL = TrainConfig(batch_size=16, virtual_shards=4)


@pytest.mark.parametrize("world, geometry, saved_world, expected", [
    (4, BatchGeometry(), None, Fit(1, 64)),  # a fresh start: one shard per rank
    (1, BatchGeometry(), None, Fit(4, 64)),  # ... or all four on one
    (2, saved(64, 1, (16, 1)), 4, Fit(2, 64, 1.0, "world size 4 -> 2: 4 virtual shards of train.batch_size 16 kept "
                                                  "(train.virtual_shards), 2 per rank; the numbers stay bitwise")),
    (2, saved(64, 2, (16, 1)), 2, Fit(2, 64)),  # a restart at the same world says nothing
], ids=["fresh-4", "fresh-1", "shrink", "same-world"])
def test_virtual_shards_keep_the_shards_and_split_them_over_the_ranks(world, geometry, saved_world, expected):
    assert fit_to_world(VIRTUAL, world, geometry, saved_world) == expected


def test_virtual_shards_the_ranks_cannot_split_evenly_are_one_config_error():
    with pytest.raises(ConfigError, match=r"world size 3: train.virtual_shards=4 cannot be split evenly over 3 ranks .*"
                                          r"world sizes that can: 1, 2, 4"):
        fit_to_world(VIRTUAL, 3, BatchGeometry(), None)


@pytest.mark.parametrize("position, global_batch, expected", [
    ((0, 0, 0), 32, 96),  # 1536 samples, 32 a step: 48 steps an epoch, 2 epochs
    ((25, 0, 800), 32, 96),  # at step 25 with the global batch kept: the plan of the first start
    ((60, 1, 384), 32, 96),
    ((25, 0, 800), 16, 25 + 46 + 96),  # keep_rank_batch shrank the global batch at step 25: done + left
    ((48, 1, 0), 64, 48 + 24),
    ((96, 2, 0), 32, 96),  # finished
], ids=["fresh", "kept-epoch0", "kept-epoch1", "rank-batch-halved", "rank-batch-doubled", "finished"])
def test_planned_steps_are_those_done_plus_those_left_at_the_global_batch(position, global_batch, expected):
    step, epoch, offset = position
    assert planned_steps(1536, global_batch, 2, None, step, epoch, offset) == expected
    assert planned_steps(1536, global_batch, 2, 50, step, epoch, offset) == min(expected, 50)
