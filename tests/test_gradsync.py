"""The bitwise-elastic mode's gradient sync on real gloo ranks: the same step at one world size and at two.

A small MLP with dropout trains three steps on a global batch of four virtual shards: in one
process (all four shards local), on two spawned gloo ranks (two shards each) and on four (one
each). With ``VirtualShards`` the parameters end bitwise equal. With DDP's accumulation (the default mode) the
same samples, without dropout, end in other bits: the sums run in another order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from elastictrain.dist.group import DistContext
from elastictrain.core.errors import ConfigError
from elastictrain.dist.gradsync import DDPAccumulation, VirtualShards, check_virtual_shards, shard_seed, tree_sum_rows
from elastictrain.launcher.launch_env import LaunchEnv
from elastictrain.snapshot.format import params_sha256
from elastictrain.dist.sync_timer import GradientSyncTimer

SHARDS, SHARD_SAMPLES, STEPS = 4, 8, 3


def _shard_batch(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + shard)
    return torch.randn(SHARD_SAMPLES, 8, generator=generator), torch.randint(0, 3, (SHARD_SAMPLES,), generator=generator)


def train(ctx: DistContext, mode: str, dropout: float) -> str:
    """STEPS optimizer steps; rank r takes shards r, r + W, ... as its micro-batches (the sampler's layout)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 3))
    timer = GradientSyncTimer()
    if mode == "virtual":
        sync = VirtualShards(model, ctx, SHARDS, seed=7, timer=timer)
    else:
        if ctx.distributed:
            model = nn.parallel.DistributedDataParallel(model)
        sync = DDPAccumulation(model, timer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    count = SHARDS // ctx.world_size
    for step in range(STEPS):
        for index in range(count):
            inputs, targets = _shard_batch(step, index * ctx.world_size + ctx.rank)
            with sync.micro_batch(index, count, step):
                loss = nn.functional.cross_entropy(model(inputs), targets)
                sync.scale(loss, count).backward()
        sync.finish(count)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return params_sha256(model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model)


def _rank(rank: int, world: int, port: int, mode: str, dropout: float, results) -> None:
    torch.set_num_threads(1)
    store = tdist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        ctx = DistContext(LaunchEnv("env", rank=rank, world_size=world), True, torch.device("cpu"), "gloo", 60.0)
        results.put((rank, train(ctx, mode, dropout)))
    finally:
        tdist.destroy_process_group()


def on_ranks(world: int, mode: str, dropout: float) -> str:
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    shas = dict(ranks.run(_rank, world, world, free_port(), mode, dropout))  # fresh ranks, forked from a preloaded server
    assert len(set(shas.values())) == 1, "the ranks of one run disagree"
    return shas[0]


def in_one_process(mode: str, dropout: float) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank
    try:
        return train(DistContext(LaunchEnv("none"), False, torch.device("cpu"), None, 60.0), mode, dropout)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_virtual_shards_end_bitwise_equal_at_one_two_and_four_ranks_with_dropout():
    alone = in_one_process("virtual", dropout=0.3)  # the whole tree on one rank
    assert on_ranks(2, "virtual", dropout=0.3) == alone  # two shards each, then one exchange
    assert on_ranks(4, "virtual", dropout=0.3) == alone  # one shard each, then two exchanges


@pytest.mark.slow
def test_ddp_accumulation_sums_in_another_order_at_another_world_size():
    """What the bitwise-elastic mode is for: without dropout, the same samples still end in other bits."""
    assert on_ranks(2, "ddp", dropout=0.0) != in_one_process("ddp", dropout=0.0)


def test_the_tree_adds_each_row_to_the_one_half_a_level_away():
    rows = torch.tensor([[1.0], [2.0], [4.0], [8.0]])
    tree_sum_rows(rows)
    assert rows[0].item() == 15.0 and rows[1].item() == 2.0 + 8.0  # (1 + 4) + (2 + 8)


def test_a_shard_seed_depends_on_the_shard_and_the_step_only():
    seeds = {shard_seed(0, step, shard) for step in range(50) for shard in range(16)}
    assert len(seeds) == 800 and all(0 <= seed < 2**63 for seed in seeds)
    assert shard_seed(0, 3, 1) == shard_seed(0, 3, 1) != shard_seed(1, 3, 1)


@pytest.mark.parametrize("model, named", [
    (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), "BatchNorm1d '1'"),
    (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64)), "float32, float64"),
])
def test_a_model_whose_numbers_depend_on_the_split_is_one_clear_line(model, named):
    with pytest.raises(ConfigError, match=named):
        check_virtual_shards(model)
    check_virtual_shards(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)))
