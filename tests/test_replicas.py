"""The replica check (replicas.py): the fingerprint sees any one element of the replicated state change, and leaves
out what differs per rank by design; on two real gloo ranks a model trained through DDP passes and one trained
without its wrapper stops both ranks with one line naming them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from elastictrain.health.replicas import Mismatch, describe, disagreements, fingerprint


def state(seed: int = 0) -> dict:
    """A model with a BatchNorm (float and integer buffers) and an Adam that has stepped once."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    F.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
    optimizer.step()
    return {"net": model, "opt": optimizer}


def changed(objects: dict, change) -> dict:
    copied = copy.deepcopy(objects)
    with torch.no_grad():
        change(copied)
    return copied


def test_equal_states_have_equal_fingerprints_covering_parameters_buffers_optimizer_state_and_hyperparameters():
    digests = fingerprint(state())
    assert digests == fingerprint(state()) == fingerprint(copy.deepcopy(state()))
    assert set(digests) == {("net", "parameters"), ("net", "buffers"), ("opt", "optimizer state"),
                            ("opt", "hyperparameters")}
    assert fingerprint(state(seed=1)) != digests


def _exp_avg(objects: dict) -> torch.Tensor:
    return next(iter(objects["opt"].state.values()))["exp_avg"]


CHANGES = {  # what one element's change makes differ
    "a weight": (lambda o: o["net"][0].weight.view(-1)[17].add_(1e-6), ("net", "parameters")),
    "the last bias element": (lambda o: o["net"][2].bias.view(-1)[-1].mul_(-1), ("net", "parameters")),
    "an integer buffer": (lambda o: o["net"][1].num_batches_tracked.add_(1), ("net", "buffers")),
    "an Adam moment": (lambda o: _exp_avg(o).view(-1)[3].add_(1e-9), ("opt", "optimizer state")),
    "an Adam step count": (lambda o: next(iter(o["opt"].state.values()))["step"].add_(1), ("opt", "optimizer state")),
    "the learning rate": (lambda o: o["opt"].param_groups[0].update(lr=0.011), ("opt", "hyperparameters")),
}


@pytest.mark.parametrize("change, part", CHANGES.values(), ids=CHANGES.keys())
def test_any_single_element_change_changes_that_part_alone(change, part):
    before = fingerprint(state())
    after = fingerprint(changed(state(), change))
    assert {p for p in before if before[p] != after[p]} == {part}


def test_two_elements_swapped_change_the_fingerprint():  # a sum would not see it
    def swap(objects):
        weight = objects["net"][0].weight.view(-1)
        weight[0], weight[1] = weight[1].item(), weight[0].item()

    assert fingerprint(changed(state(), swap))[("net", "parameters")] != fingerprint(state())[("net", "parameters")]


def test_floating_point_buffers_are_left_out():
    """BatchNorm's running statistics: each rank updates them from its own batch, DDP sends rank 0's at the next forward."""
    def running_mean(objects):
        objects["net"][1].running_mean.add_(1.0)

    assert fingerprint(changed(state(), running_mean)) == fingerprint(state())


def test_an_object_in_a_param_group_counts_by_its_type_not_its_per_process_repr():
    objects = state()
    objects["opt"].param_groups[0]["hook"] = lambda: None  # its repr holds an address that differs per process
    other = state()
    other["opt"].param_groups[0]["hook"] = lambda: None
    assert fingerprint(objects) == fingerprint(other)


def test_only_models_and_optimizers_are_fingerprinted():
    objects = state()
    scheduler = torch.optim.lr_scheduler.StepLR(objects["opt"], step_size=1)
    assert fingerprint({**objects, "scheduler": scheduler, "nothing": None}) == fingerprint(objects)


def test_dtensor_shards_are_left_out_and_replicated_dtensors_compared():
    """dist.strategy=fsdp: a sharded parameter differs per rank by design; a replicated one does not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = tdist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def model(placement, value: float) -> nn.Module:
            module = nn.Linear(2, 2)
            module.weight = nn.Parameter(distribute_tensor(torch.full((2, 2), value), mesh, [placement]))
            return module

        def digest(placement, value):
            torch.manual_seed(0)
            return fingerprint({"m": model(placement, value)})[("m", "parameters")]

        assert digest(Shard(0), 1.0) == digest(Shard(0), 2.0)
        assert digest(Replicate(), 1.0) != digest(Replicate(), 2.0)
    finally:
        tdist.destroy_process_group()


def test_disagreements_name_the_differing_parts_and_group_the_ranks():
    a, b = {("m", "parameters"): 1, ("o", "optimizer state"): 5}, {("m", "parameters"): 2, ("o", "optimizer state"): 5}
    assert disagreements([a, a, a]) is None
    assert disagreements([a, b, a, b]) == Mismatch([("m", "parameters")], [[0, 2], [1, 3]])
    c = {("m", "parameters"): 2, ("o", "optimizer state"): 6}
    assert disagreements([a, b, c]) == Mismatch([("m", "parameters"), ("o", "optimizer state")], [[0], [1], [2]])
    assert disagreements([a, {("m", "parameters"): 1}]) == Mismatch([("o", "optimizer state")], [[0], [1]])


def test_the_line_names_step_ranks_and_objects():
    mismatch = Mismatch([("model", "parameters"), ("model", "buffers"), ("opt", "optimizer state")],
                        [[0, 1, 2, 5], [3, 4]])
    line = describe(40, "the durable snapshot", mismatch)
    assert "\n" not in line
    assert line.startswith("the ranks' replicas differ at step 40, before the durable snapshot: ranks 0-2,5 | 3-4 hold "
                           "different 'model' (parameters, buffers), 'opt' (optimizer state); nothing of this step was "
                           "committed."), line
    assert "session.wrap()" in line and "dist.check_replicas=false" in line


# -- two real gloo ranks --------------------------------------------------------------------------

def _rank(rank: int, port: int, through_wrapper: bool, results) -> None:
    from elastictrain.dist.ddp import wrap_model
    from elastictrain.core.config import DistConfig
    from elastictrain.dist.group import DistContext, teardown
    from elastictrain.core.errors import ReplicasDiverged
    from elastictrain.launcher.launch_env import LaunchEnv
    from elastictrain.health.replicas import ReplicaCheck

    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 60.0)
    try:
        torch.manual_seed(0)  # the same initial weights on both ranks
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        wrapped = wrap_model(model, ctx, DistConfig())
        trained = wrapped if through_wrapper else model
        check = ReplicaCheck(ctx, {"model": model, "optimizer": optimizer, "scheduler": None}, enabled=True)
        torch.manual_seed(1 + rank)  # each rank its own data
        for _ in range(3):
            F.cross_entropy(trained(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
            optimizer.step()
            optimizer.zero_grad()
        running_means: list = [None, None]
        tdist.all_gather_object(running_means, model[1].running_mean)
        bn_means_differ = not torch.equal(*running_means)
        try:
            check.check(3, "the durable snapshot")
        except ReplicasDiverged as exc:
            results.put((rank, str(exc), bn_means_differ, None))
            return
        # Agreed at step 3: the run's end at step 3 (after snapshot.durable.on_done's) compares nothing again, until
        # a rollback trains the step again. Rank 1's change stands for what would differ, were it compared.
        if rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] += 1
        compared_again = []
        for forget in (False, True):
            if forget:
                check.forget()
            try:
                check.check(3, "the run's end")
                compared_again.append(False)
            except ReplicasDiverged:
                compared_again.append(True)
        results.put((rank, None, bn_means_differ, compared_again))
    finally:
        teardown(ctx)  # not a bare destroy_process_group(): gloo's threads can abort the exit (dist.teardown says why)


@pytest.mark.parametrize("through_wrapper", [True, False], ids=["ddp", "raw-module"])
def test_on_two_gloo_ranks_ddp_passes_and_the_raw_module_stops_both_ranks_naming_them(through_wrapper):
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    context = ranks.context()
    results = context.Queue()
    port = free_port()
    workers = [context.Process(target=_rank, args=(rank, port, through_wrapper, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        said, bn_means_differ, compared_again = {}, [], {}
        for _ in workers:
            rank, message, differ, again = results.get(timeout=60)
            said[rank] = message
            bn_means_differ.append(differ)
            compared_again[rank] = again
        if through_wrapper:
            assert said == {0: None, 1: None}
            assert compared_again == {0: [False, True], 1: [False, True]}  # skipped at the same step; after forget(), not
        else:
            assert said[0] == said[1] and said[0].startswith(
                "the ranks' replicas differ at step 3, before the durable snapshot: ranks 0 | 1 hold different 'model' "
                "(parameters), 'optimizer' (optimizer state); nothing of this step was committed."), said
        assert all(bn_means_differ)  # BatchNorm's statistics differ per rank under DDP too: left out by design
        for worker in workers:
            worker.join(30)
        assert [worker.exitcode for worker in workers] == [0, 0]
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
