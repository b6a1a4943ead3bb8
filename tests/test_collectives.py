"""The one "rank 0 acts, every rank agrees" helper, on two real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

from elastictrain.dist.collectives import carried, main_acts, raise_carried
from elastictrain.dist.group import DistContext
from elastictrain.core.errors import ElastictrainError, SnapshotError, StorageUnavailable
from elastictrain.launcher.launch_env import LaunchEnv


def _rank(rank: int, port: int, results) -> None:
    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 60.0)
        acted = []
        value = main_acts(lambda: acted.append(rank) or {"run_id": "abc"}, ctx)

        def refuse():
            raise StorageUnavailable("the store did not answer; retry later")

        try:
            main_acts(refuse, ctx)
            raised = None
        except ElastictrainError as exc:
            raised = (type(exc).__name__, str(exc))
        results.put((rank, acted, value, raised))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_rank_0_acts_alone_and_every_rank_returns_its_result_or_raises_its_user_error():
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    out = dict((rank, rest) for rank, *rest in ranks.run(_rank, 2, free_port()))
    raised = ("StorageUnavailable", "the store did not answer; retry later")
    assert out[0] == [[0], {"run_id": "abc"}, raised]
    assert out[1] == [[], {"run_id": "abc"}, raised]


@pytest.mark.parametrize("error, expected", [
    (SnapshotError("snapshot s3://b/step-1 is corrupt"), SnapshotError),
    (StorageUnavailable("no answer"), StorageUnavailable),
])
def test_a_carried_error_is_raised_again_with_its_class_and_message(error, expected):
    with pytest.raises(expected) as raised:
        raise_carried(carried(error))
    assert type(raised.value) is expected and str(raised.value) == str(error)


def test_a_carried_error_of_a_class_this_side_does_not_know_is_an_elastictrain_error():
    with pytest.raises(ElastictrainError, match="^from a newer version$"):
        raise_carried(("NoSuchError", "from a newer version"))
    raise_carried(None)
