"""The session's public collectives and its read-only config: the arithmetic as a table, the calls in one process,
and the collectives on two real gloo ranks (forked processes, as tests/test_vote.py runs them)."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed as tdist

from elastictrain.dist.collectives import all_gather, all_reduce, broadcast_from_main
from elastictrain.dist.group import DistContext
from elastictrain.core.errors import UsageError
from elastictrain.launcher.launch_env import LaunchEnv
from elastictrain.dist.reduce import reduce_means, weighted_means
from elastictrain.train.session import Session


@pytest.mark.parametrize("parts, expected", [
    ([(3.0, {"loss": 1.0}), (1.0, {"loss": 5.0})], {"loss": 2.0}),  # sample-weighted, not a plain mean (3.0)
    ([(2.0, {"loss": 1.0, "acc": 0.5}), (0.0, {})], {"loss": 1.0, "acc": 0.5}),  # a rank with no sample
    ([(1.0, {"loss": 1.0, "f1": 0.2}), (3.0, {"loss": 3.0})], {"loss": 2.5, "f1": 0.2}),  # a name one rank lacks
    ([(0.0, {}), (0.0, {})], {}),
    ([(0.0, {"loss": 1.0})], {}),  # weighs nothing: no mean
])
def test_weighted_means(parts, expected):
    assert weighted_means(parts) == pytest.approx(expected)


def config(tmp_path) -> dict:
    return {"run": {"dir": str(tmp_path / "run")}, "log": {"progress_bar": False, "plots": False},
            "snapshot": {"durable": {"url": f"memory://session-collectives/{uuid.uuid4().hex}"}},
            "train": {"max_steps": 1, "batch_size": 8}}


def test_one_process_collectives_and_the_read_only_config(tmp_path):
    with Session(config(tmp_path)) as session:
        assert session.all_reduce(3) == 3 and isinstance(session.all_reduce(3, op="max"), int)
        assert session.all_reduce(3, op="mean") == 3.0
        summed = torch.tensor([1.0, 2.0])
        assert torch.equal(session.all_reduce(summed), summed) and session.all_reduce(summed) is not summed
        assert session.all_gather({"a": 1}) == [{"a": 1}] and session.broadcast("x") == "x"
        assert session.reduce_metrics({"loss": 0.5}, weight=4) == {"loss": 0.5}
        with pytest.raises(UsageError, match=r"^all_reduce\(op='avg'\): op is one of sum, max, min, mean$"):
            session.all_reduce(1.0, op="avg")
        assert session.config.train.batch_size == 8 and session.config.train.max_steps == 1
        with pytest.raises(UsageError) as raised:
            session.config.train.batch_size = 16
        assert str(raised.value) == (
            "session.config.train.batch_size is read-only: the session read its config at SETUP; set "
            "train.batch_size in the config or as an override (train.batch_size=...) instead")
        with pytest.raises(TypeError):  # a read-only mapping
            session.config.snapshot.durable.storage_options["key"] = "x"
    with pytest.raises(UsageError, match=r"^session.all_gather\(\) after the `with Session"):
        session.all_gather(1)


def _rank(rank: int, port: int, results) -> None:
    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 60.0)
        results.put((rank, {
            "sum": all_reduce(torch.tensor([1.0, 2.0]) * (rank + 1), "sum", ctx).tolist(),
            "max": all_reduce(rank + 5, "max", ctx),
            "min": all_reduce(float(rank) - 1, "min", ctx),
            "mean": all_reduce(torch.tensor([rank]), "mean", ctx).tolist(),
            "gather": all_gather(f"r{rank}", ctx),
            "broadcast": broadcast_from_main({"from": rank}, ctx, src=1),
            "metrics": reduce_means({"loss": 1.0 + 4 * rank, **({"f1": 0.5} if rank == 0 else {})}, 3 - 2 * rank, ctx),
        }))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_the_collectives_on_two_gloo_ranks():
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    seen = dict(ranks.run(_rank, 2, free_port()))
    expected = {"sum": [3.0, 6.0], "max": 6, "min": -1.0, "mean": [0.5], "gather": ["r0", "r1"],
                "broadcast": {"from": 1}, "metrics": {"loss": 2.0, "f1": 0.5}}  # loss: (3 * 1 + 1 * 5) / 4
    assert seen == {0: expected, 1: expected}
