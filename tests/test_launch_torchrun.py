"""launch/torchrun: two agents on this machine form one job as two nodes and train the default job."""

from __future__ import annotations

import inspect
import re
import signal
import subprocess

import pytest

from elastictrain.core.config_load import load_config
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals
from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.agents import MULTI_NODE_SCRIPT, TORCHRUN, NodeGroup

TIMEOUT_S = 120
SINGLE_NODE_SCRIPT = MULTI_NODE_SCRIPT.parent / "single_node.sh"
PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


def expected_steps(overrides: list[str], world_size: int) -> int:
    """Optimizer steps of the default task: an incomplete last step of each epoch is dropped."""
    cfg = load_config(None, overrides)
    train_samples = inspect.signature(spirals.build).parameters["train_samples"].default
    per_step = cfg.train.batch_size * world_size * cfg.train.grad_accum_steps
    return cfg.train.max_epochs * (train_samples // per_step)


@pytest.mark.torchrun
def test_two_agents_are_two_nodes_of_one_job(tmp_path):
    overrides = [f"run.dir={tmp_path / 'run'}", "train.max_epochs=1"]
    nodes = NodeGroup(tmp_path, ["-m", "elastictrain", "train", *overrides], nnodes="2", nproc_per_node=1)
    nodes.launch(0, host_store=True)
    nodes.launch(1, host_store=False)
    codes = nodes.wait(TIMEOUT_S)
    output = nodes.output()
    assert codes == {0: 0, 1: 0}, output[-4000:]

    # Each agent started a worker of its own: two nodes, one world of two.
    assert nodes.worker_pids(0) and nodes.worker_pids(1)
    assert not nodes.worker_pids(0) & nodes.worker_pids(1)
    result = parse_job(output)
    assert result.summary["state"] == "DONE"
    assert result.summary["world_size"] == "2"
    assert result.summary["restart"] == "0"
    assert int(result.summary["step"]) == expected_steps(overrides, world_size=2)
    assert output.count("run summary:") == 1, "only global rank 0 logs the summary"
    assert nodes.leftover_pids() == [], "every agent and worker must have exited"


@pytest.mark.torchrun
def test_usr1_to_the_agent_reaches_every_worker_and_leaves_a_snapshot(tmp_path):
    """SLURM's time-limit warning is USR1: the script's torchrun must forward it (its default set lacks it)."""
    run_dir = tmp_path / "run"
    nodes = NodeGroup(tmp_path, ["-m", "elastictrain", "train", f"run.dir={run_dir}", "train.max_epochs=100",
                                 "train.log_every_steps=5"], nnodes="1", nproc_per_node=2)
    agent = nodes.launch(0)
    agent.wait_for(lambda text: re.search(r"\bstep \d+ epoch", text) is not None, TIMEOUT_S, "training under way")
    nodes.signal(0, signal.SIGUSR1)
    assert nodes.wait(TIMEOUT_S) == {0: 1}, "torchrun exits 1 after a forwarded signal (launch/README.md)"
    found = PREEMPTED.findall(agent.output())
    assert len(found) == 1, agent.output()[-4000:]
    manifest, _ = SnapshotStore(str(run_dir / "snapshots")).latest_valid()
    assert manifest.step == int(found[0])
    assert nodes.leftover_pids() == []


@pytest.mark.torchrun
def test_single_node_script_trains_one_worker_per_process_asked(tmp_path):
    overrides = [f"run.dir={tmp_path / 'run'}", "train.max_steps=20", "log.plots=false"]
    env = {"TORCHRUN": TORCHRUN, "NPROC_PER_NODE": "2", "TORCHRUN_ARGS": "--monitor-interval=0.1"}
    job = procs.launch(["bash", str(SINGLE_NODE_SCRIPT), "-m", "elastictrain", "train", *overrides],
                       log_path=tmp_path / "job.log", env=env, cwd=tmp_path)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    summary = parse_job(job.output()).summary
    assert (summary["state"], summary["step"], summary["world_size"]) == ("DONE", "20", "2")


@pytest.mark.slow
def test_multi_node_script_refuses_to_start_without_endpoint_or_run_id(tmp_path):
    for missing in ("RDZV_ENDPOINT", "RDZV_ID"):
        env = {"RDZV_ENDPOINT": "127.0.0.1:29400", "RDZV_ID": "x", "TORCHRUN": "false"}
        del env[missing]
        run = subprocess.run(["bash", str(MULTI_NODE_SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
        assert run.returncode != 0
        assert f"set {missing}" in run.stderr, run.stderr
