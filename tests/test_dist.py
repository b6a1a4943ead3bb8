"""Launch-environment detection: torchrun, SLURM, plain variables, none; explicit settings override."""

from __future__ import annotations

import pytest

from elastictrain.core.config import DistConfig
from elastictrain.dist.group import setup
from elastictrain.core.errors import ConfigError, DistributedSetupError
from elastictrain.launcher.launch_env import detect_launch_env, first_slurm_host

TORCHRUN = {
    "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
    "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "True",
}
SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "4242",
         "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_RESTART_COUNT": "1"}


def test_torchrun_variables():
    env = detect_launch_env(TORCHRUN)
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("torchrun", 3, 1, 4)
    assert (env.restart_count, env.run_id, env.uses_agent_store) == (2, "job7", True)


def test_torchrun_inside_srun_wins_over_slurm():
    assert detect_launch_env({**SLURM, **TORCHRUN}).launcher == "torchrun"


def test_slurm_variables_and_master_from_the_node_list():
    env = detect_launch_env(SLURM)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.restart_count) == ("slurm", 5, 1, 8, 1)
    assert env.master_addr == "gpu07" and env.master_port == 12000 + 4242
    assert detect_launch_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"


@pytest.mark.parametrize(
    "nodelist, first", [("node1", "node1"), ("gpu[07-09,12]", "gpu07"), ("a[3],b[1-2]", "a3"), ("x-1,y", "x-1")]
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_no_launcher_means_one_process():
    assert detect_launch_env({}).launcher == "none"
    ctx = setup(DistConfig(), environ={})
    assert (ctx.distributed, ctx.rank, ctx.world_size, ctx.is_main, ctx.device.type) == (False, 0, 1, True, "cpu")


def test_distributed_false_overrides_the_environment():
    ctx = setup(DistConfig(distributed=False), environ=TORCHRUN)
    assert not ctx.distributed and ctx.world_size == 1 and ctx.rank == 0


def test_distributed_true_without_a_launcher_is_a_clear_error():
    with pytest.raises(DistributedSetupError, match="no torchrun, SLURM or RANK/WORLD_SIZE"):
        setup(DistConfig(distributed=True), environ={})


def test_incomplete_torchrun_environment_is_a_clear_error():
    with pytest.raises(DistributedSetupError, match="incomplete launch environment"):
        detect_launch_env({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"})


def test_nccl_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="nccl needs a CUDA device"):  # no restart fixes it: not retried
        setup(DistConfig(backend="nccl", device="cpu"), environ={"RANK": "0", "WORLD_SIZE": "2"})


def test_ddp_wrapping_options_on_a_real_one_rank_gloo_group():
    import torch
    import torch.distributed as tdist
    from torch import nn

    from elastictrain.dist.ddp import unwrap, wrap_model
    from elastictrain.dist.group import DistContext
    from elastictrain.launcher.launch_env import LaunchEnv

    store = tdist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ctx = DistContext(LaunchEnv("env"), True, torch.device("cpu"), "gloo", 60.0)
        model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))
        from_env = wrap_model(model, ctx, DistConfig(), environ={"DDP_FIND_UNUSED_PARAMETERS": "true"})
        assert isinstance(from_env, nn.parallel.DistributedDataParallel) and from_env.find_unused_parameters
        explicit = wrap_model(nn.Linear(2, 2), ctx, DistConfig(find_unused_parameters=False), environ={"DDP_FIND_UNUSED_PARAMETERS": "1"})
        assert not explicit.find_unused_parameters
        assert isinstance(unwrap(explicit), nn.Linear)
        with pytest.raises(ConfigError, match="sync_batchnorm=true needs CUDA"):
            wrap_model(nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4)), ctx, DistConfig(sync_batchnorm=True), environ={})
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("recorded, restart, round_id, repeated", [
    # A membership change does not bump the agent's restart count: only the round tells attempts apart.
    ({"restart": 1, "round": "a"}, 1, "b", True),
    ({"restart": 1, "round": "a"}, 0, "a", False),  # a rank of this very round, on a node that joined later
    ({"restart": 1, "round": "a"}, 2, "a", False),
    # A config error is recorded before any round is agreed: the restart count is all there is.
    ({"restart": 0, "round": ""}, 1, "b", True),
    ({"restart": 0, "round": ""}, 0, "b", False),
])
def test_a_fatal_error_stops_later_rounds_and_not_its_own(recorded, restart, round_id, repeated):
    import json

    import torch.distributed as tdist

    from elastictrain.dist.group import FATAL_KEY, check_no_fatal_error
    from elastictrain.core.errors import RepeatedFatalError
    from elastictrain.launcher.launch_env import LaunchEnv

    store = tdist.HashStore()
    store.set(FATAL_KEY, json.dumps({**recorded, "rank": 0, "exit_code": 1, "kind": "SnapshotError"}))
    env = LaunchEnv("torchrun", restart_count=restart)
    if repeated:
        with pytest.raises(RepeatedFatalError, match=f"restart {restart} skipped: attempt {recorded['restart']} stopped"):
            check_no_fatal_error(store, env, round_id)
    else:
        check_no_fatal_error(store, env, round_id)


def test_a_torchrun_job_keeps_its_snapshot_lease_token_when_the_store_holding_it_is_new():
    """Lose the node that hosts the workers' store (etcd rendezvous) and the new rank 0 hosts a new,
    empty one: the lease token must not live only there, or the job's own lease would refuse it."""
    import torch
    import torch.distributed as tdist

    from elastictrain.dist.group import DistContext
    from elastictrain.launcher.launch_env import LaunchEnv
    from elastictrain.snapshot.lease_keeper import job_token

    def token(run_id, store):
        return job_token(DistContext(LaunchEnv("torchrun", run_id=run_id), True, torch.device("cpu"), "gloo", 60.0, store))

    assert token("exp1", tdist.HashStore()) == token("exp1", tdist.HashStore()) == token("exp1", None) == "torchrun exp1"
    # torchrun's default --rdzv-id is every such job's: there the token is drawn once per store.
    store = tdist.HashStore()
    assert token("none", store) == token("none", store) != token("none", tdist.HashStore())


@pytest.mark.parametrize("url, max_restarts, refused", [
    ("memory://run/snapshots", 3, True),
    ("simplecache::memory://run", 1, True),
    ("MEMORY://run", 1, True),
    ("memory://run/snapshots", 0, False),  # nothing restarts these processes
    ("/shared/run/snapshots", 3, False),
    ("s3://bucket/run", 3, False),
    ("file:///tmp/memory://x", 3, False),  # a path, not the memory filesystem
])
def test_a_store_inside_the_process_is_refused_when_restarts_are_new_processes(url, max_restarts, refused):
    from elastictrain.launcher.launch_env import store_lost_on_restart

    env = detect_launch_env({**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)})
    assert env.max_restarts == max_restarts
    problem = store_lost_on_restart(url, env)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"snapshot.durable.url={url} lives in this process's memory") and "\n" not in problem
