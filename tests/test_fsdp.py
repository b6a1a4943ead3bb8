"""dist.strategy=fsdp under real torchrun: FSDP2 models, sharded snapshots (DCP), resharding resumes, the export.

One unbroken 2-worker fsdp run is the reference; a run whose rank 1 is SIGKILLed mid-training must
end with its very parameters, and so must a run resumed past a corrupt shard. A job trained at 4,
then 2, then 3 workers restores each time from shards written at another world size, and its last
snapshot, exported, loads into a plain module.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import sys

import pytest
import torch
from filelock import FileLock
from torch import nn

from elastictrain.snapshot import fast_restore, fast_shards
from elastictrain.dist import fsdp
from elastictrain.core.config_load import load_config
from elastictrain.core.errors import ConfigError
from elastictrain.storage.manifest import Manifest
from elastictrain.snapshot.format import params_sha256
from elastictrain.train.tasks import spirals

from tests.conftest import WARM, job_env, parse_job, torchrun_command
from tests.helpers import devices, procs
from tests.helpers.corrupt import flip_middle_byte
from tests.helpers.agents import NodeGroup
from tests.helpers.jobs import JOB, TIMEOUT_S, start_steps

FSDP = [*JOB, "dist.strategy=fsdp", "train.max_epochs=2", "task.args.val_samples=101"]  # 96 steps at 2 workers


def launch(tmp_path, name: str, extra: list[str] = (), nproc: int = 2, run_dir=None) -> procs.Launched:
    (tmp_path / "trace").mkdir(exist_ok=True)
    overrides = [*FSDP, f"task.args.trace_dir={tmp_path / 'trace'}", f"run.dir={run_dir or tmp_path / 'run'}", *extra]
    return procs.launch(torchrun_command(overrides, nproc=nproc, warmstart=True), log_path=tmp_path / f"{name}.log",
                        env=job_env(), cwd=tmp_path)


def finished(job: procs.Launched):
    assert job.wait(TIMEOUT_S * 2) == 0, job.output()[-4000:]
    result = parse_job(job.output())
    assert result.summary["state"] == "DONE", job.output()[-4000:]
    return result


def manifest(run_dir, step: int) -> dict:
    return json.loads((run_dir / "snapshots" / f"step-{step:012d}" / "manifest.json").read_text())


def fsdp_reference(tmp_path_factory, variant: devices.Variant = devices.CPU):
    """The unbroken fsdp run of ``variant``, once for the xdist workers together (as tests/conftest.py's reference_run)."""
    shared = tmp_path_factory.getbasetemp().parent if "PYTEST_XDIST_WORKER" in os.environ else tmp_path_factory.getbasetemp()
    workdir = shared / ("fsdp-reference" if variant is devices.CPU else f"fsdp-reference-{variant.name}")
    workdir.mkdir(exist_ok=True)
    with FileLock(str(workdir / "reference.lock")):
        if (workdir / "reference.pickle").exists():
            return workdir, pickle.loads((workdir / "reference.pickle").read_bytes())
        result = finished(launch(workdir, "reference", variant.overrides))
        (workdir / "reference.pickle").write_bytes(pickle.dumps(result))
        return workdir, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fsdp_reference(tmp_path_factory)


# FSDP2 on one GPU: both ranks' shards on cuda:0, gloo's collectives on CUDA tensors (NCCL needs a GPU per rank).
FSDP_VARIANTS = [devices.CPU.param(), devices.CUDA_FP32.param()]


@pytest.mark.torchrun
@pytest.mark.parametrize("variant", FSDP_VARIANTS)
def test_fsdp_sigkill_mid_training_resumes_bitwise_from_every_ranks_shards(tmp_path, tmp_path_factory, variant):
    ref_dir, ref = fsdp_reference(tmp_path_factory, variant)
    # Every rank's DCP file, DCP's metadata and rank 0's state.pt, each with its size and checksum; no model.pt.
    objects = manifest(ref_dir / "run", 96)["objects"]
    assert sorted(objects) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    assert all(entry["size"] > 0 and entry["digest"] for entry in objects.values())

    job = launch(tmp_path, "killed", [*variant.overrides, "task.args.pause_rank=1", "task.args.pause_at_step=60"])
    os.kill(int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)), signal.SIGKILL)
    result = finished(job)
    assert start_steps(result.output) == [0, 50], "expected one restart, from the snapshot of step 50"
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]
    if variant.cuda:
        assert result.output.count(devices.DETERMINISM_LINE) == 2


@pytest.mark.torchrun
def test_fsdp_on_s3_sigkill_mid_training_resumes_bitwise_and_the_snapshot_verifies(tmp_path, reference, s3_server, s3_bucket):
    """The shards go through DCP's FsspecWriter to a real S3 server (SeaweedFS) and come back through its FsspecReader."""
    ref_dir, ref = reference
    url, options = f"s3://{s3_bucket}/run", s3_server.storage_options
    s3 = [f"snapshot.durable.url={url}", f"snapshot.durable.storage_options.endpoint_url={s3_server.endpoint}",
          f"snapshot.durable.storage_options.key={options['key']}", f"snapshot.durable.storage_options.secret={options['secret']}"]
    job = launch(tmp_path, "killed", [*s3, "task.args.pause_rank=1", "task.args.pause_at_step=60"])
    os.kill(int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)), signal.SIGKILL)
    result = finished(job)
    assert start_steps(result.output) == [0, 50], "expected one restart, from the S3 snapshot of step 50"
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]

    verify = procs.launch([sys.executable, "-m", "elastictrain", "snapshots", "verify", url, "--json",
                           *(f"--storage-option={o.removeprefix('snapshot.durable.storage_options.')}" for o in s3[1:])],
                          log_path=tmp_path / "verify.log", env=job_env(), cwd=tmp_path)
    assert verify.wait(TIMEOUT_S) == 0, verify.output()
    document = json.loads(verify.output())
    assert document["newest_step"] == 96 and document["newest_valid"] is True, document
    objects = manifest_on(s3_server, s3_bucket, 96)["objects"]
    assert sorted(objects) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]


@pytest.mark.torchrun
def test_fsdp_async_write_killed_inside_a_background_write_leaves_no_snapshot_and_resumes_bitwise(tmp_path, reference):
    """snapshot.durable.async_write=true: every rank writes its shards in a thread; rank 0 is SIGKILLed in its writer
    of step 75 after every rank's shards are written, before state.pt and the manifest: the restart restores step 50."""
    _, ref = reference
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    env = {**job_env(), "ELASTICTRAIN_FAILPOINT": f"snapshot-write@75:{failpoints}"}
    (tmp_path / "trace").mkdir()
    overrides = [*FSDP, f"task.args.trace_dir={tmp_path / 'trace'}", f"run.dir={tmp_path / 'run'}",
                 "snapshot.durable.async_write=true"]
    job = procs.launch(torchrun_command(overrides, nproc=2), log_path=tmp_path / "job.log", env=env, cwd=tmp_path)
    writer_pid = int(procs.wait_for_file(failpoints / "failpoint-snapshot-write.pid", TIMEOUT_S, job))
    torn = tmp_path / "run" / "snapshots" / f"step-{75:012d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {path.name for path in torn.iterdir()}
    assert not (torn / "manifest.json").exists()
    os.kill(writer_pid, signal.SIGKILL)
    result = finished(job)
    assert re.search(r"skipping snapshot \S+step-000000000075: no manifest", result.output), result.output[-4000:]
    assert start_steps(result.output) == [0, 50], "expected one restart, from the snapshot of step 50"
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]
    assert sorted(manifest(tmp_path / "run", 96)["objects"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]


@pytest.mark.torchrun
def test_fsdp_async_write_of_staged_shards_goes_on_behind_training_and_resumes_bitwise(tmp_path, reference):
    """Rank 0's writer thread is held before it writes step 50's shards while both ranks train on to step 74 (rank 1
    pauses there): step 50's snapshot, committed only then, must hold step 50's state (staged), not step 74's.
    Rank 1 SIGKILLed at step 74, the restart restores step 50 and ends with the unbroken run's parameters."""
    _, ref = reference
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    env = {**job_env(), "ELASTICTRAIN_FAILPOINT": f"shards-write@50:{failpoints}", "ELASTICTRAIN_FAILPOINT_RANK": "0"}
    (tmp_path / "trace").mkdir()
    overrides = [*FSDP, f"task.args.trace_dir={tmp_path / 'trace'}", f"run.dir={tmp_path / 'run'}",
                 "snapshot.durable.async_write=true", "task.args.pause_rank=1", "task.args.pause_at_step=74"]
    job = procs.launch(torchrun_command(overrides, nproc=2), log_path=tmp_path / "job.log", env=env, cwd=tmp_path)
    procs.wait_for_file(failpoints / "failpoint-shards-write.pid", TIMEOUT_S, job)
    paused = procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)  # training went on meanwhile
    assert not (tmp_path / "run" / "snapshots" / f"step-{50:012d}" / "manifest.json").exists()
    (failpoints / "failpoint-shards-write.resume").touch()
    job.wait_for(lambda out: "step-000000000050 committed" in out, TIMEOUT_S, "step 50's snapshot")
    os.kill(int(paused), signal.SIGKILL)
    result = finished(job)
    assert start_steps(result.output) == [0, 50], "expected one restart, from the snapshot of step 50"
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]


def manifest_on(s3_server, bucket: str, step: int) -> dict:
    return json.loads(s3_server.client().cat_file(f"{bucket}/run/step-{step:012d}/manifest.json"))


@pytest.mark.torchrun
def test_fsdp_corrupt_shard_skips_that_snapshot_and_resumes_bitwise_from_the_one_before(tmp_path, reference):
    ref_dir, ref = reference
    shutil.copytree(ref_dir / "run" / "snapshots", tmp_path / "run" / "snapshots")
    # one flipped byte in rank 1's shard of the newest snapshot
    flip_middle_byte(tmp_path / "run" / "snapshots" / f"step-{96:012d}" / "__1_0.distcp")

    result = finished(launch(tmp_path, "resumed", ["snapshot.accept_changes=[task.args.trace_dir]"]))
    assert re.search(r"WARNING skipping snapshot \S+step-000000000096: .*object '__1_0.distcp' xxh3_128 mismatch",
                     result.output), result.output[-4000:]
    assert start_steps(result.output) == [75]
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]


@pytest.mark.torchrun
@pytest.mark.parametrize("variant", FSDP_VARIANTS)
def test_fsdp_resumes_at_4_then_2_then_3_workers_resharding_and_exports_a_plain_state_dict(tmp_path, variant):
    """Trained at 4 workers to step 12 and at 2 to step 30, the job is relaunched at 3 with nothing left to train:
    its parameters, read from 2 ranks' shards into 3, are bitwise those the 2-worker run ended with. On CUDA every
    rank's shards are on the one GPU, and the export reads them onto the CPU."""
    reshard = [*variant.overrides, "train.on_world_size_change=keep_rank_batch", "snapshot.durable.every_steps=10"]
    results = {}
    for nproc, max_steps in ((4, 12), (2, 30), (3, 30)):
        results[nproc] = finished(launch(tmp_path, f"world{nproc}", [*reshard, f"train.max_steps={max_steps}"], nproc))
    assert results[4].summary["world_size"] == "4" and start_steps(results[4].output) == [0]
    for nproc, saved_world, step in ((2, 4, 12), (3, 2, 30)):
        assert start_steps(results[nproc].output) == [step]
        assert f"was taken with world size {saved_world}, this run has {nproc}" in results[nproc].output
        assert results[nproc].summary["step"] == "30"
    assert results[3].summary["params_sha256"] == results[2].summary["params_sha256"]

    out = tmp_path / "model.pt"
    exported = procs.launch([sys.executable, "-m", "elastictrain", "snapshots", "export", str(tmp_path / "run" / "snapshots"),
                             "--out", str(out)], log_path=tmp_path / "export.log", env=job_env(), cwd=tmp_path)
    assert exported.wait(TIMEOUT_S) == 0, exported.output()
    model = spirals.SpiralNet(classes=3, hidden=64, dropout=0.1)
    model.load_state_dict(torch.load(out, weights_only=True))
    assert params_sha256(model) == results[2].summary["params_sha256"]


@pytest.mark.torchrun
def test_fsdp_self_healing_rolls_back_from_the_shards_and_skips_a_poisoned_batch(tmp_path):
    """A NaN sample on rank 1 (anomaly.policy=rollback, the default): rolled back twice in the running process,
    reading the shards, while rank 0's weights check (no sighting of its own) must not start a collective alone."""
    result = finished(launch(tmp_path, "poisoned", ["train.max_epochs=1", "task.args.poison=700",
                                                    "snapshot.durable.every_steps=10"]))
    assert "rolled back to step 30 to replay it (rollback 1 of 4)" in result.output, result.output[-4000:]
    assert "anomaly at step 35 recurred on replay (loss nan): it is the data" in result.output
    assert result.summary["step"] == "47" and start_steps(result.output) == [0]


FAST = ["snapshot.local.every_steps=5"]  # durable copies at 25, 50, 75; fast ones every 5 steps between them
RDZV_CONF = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 4}  # whole seconds: a fixed world of two


def copy_files(directory, step: int) -> list[str]:
    """The files of a node's fast copy of ``step`` (``directory``: snapshot.local.url; one run's copies in it)."""
    (run_copies,) = (directory / "default").iterdir()  # <run.name>/<run id>
    return sorted(path.name for path in (run_copies / f"step-{step:012d}").iterdir())


@pytest.mark.torchrun
def test_fsdp_sigkill_with_the_fast_tier_restores_every_ranks_shards_from_the_node_bitwise(tmp_path, reference):
    """Rank 1 is SIGKILLed in step 60: the restart reads the node's fast copy of step 55 (each rank's own DCP file,
    DCP's .metadata, state.pt), newer than the durable step 50, and ends with the unbroken run's parameters."""
    _, ref = reference
    job = launch(tmp_path, "killed", [f"snapshot.local.url={tmp_path}/shm", *FAST, "task.args.pause_rank=1",
                                      "task.args.pause_at_step=60"])
    paused = int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job))
    assert copy_files(tmp_path / "shm", 55) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "state.pt"]
    os.kill(paused, signal.SIGKILL)
    result = finished(job)
    assert "restored step 55 from the node-local tier: node 0's shards (ranks 0, 1) from node 0's own copy" in result.output, \
        result.output[-4000:]
    assert start_steps(result.output) == [0, 55], "expected one restart, from the fast copy of step 55"
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]
    assert "no survivor copies (snapshot.local.survivor_copies): dist.strategy=fsdp: the dead rank's shards" in result.output


@pytest.mark.torchrun
def test_fsdp_corrupt_shard_in_a_fast_copy_skips_that_copy_and_restores_the_one_before_bitwise(tmp_path, reference):
    """While rank 1 is paused in step 60, one byte of rank 0's shard in the fast copy of step 55 is flipped: the restart
    skips that copy (no node holds the file intact) and restores the copy of step 50."""
    _, ref = reference
    job = launch(tmp_path, "killed", [f"snapshot.local.url={tmp_path}/shm", *FAST, "task.args.pause_rank=1",
                                      "task.args.pause_at_step=60"])
    paused = int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job))
    (shard,) = (tmp_path / "shm" / "default").glob(f"*/step-{55:012d}/__0_0.distcp")
    flip_middle_byte(shard)
    os.kill(paused, signal.SIGKILL)
    result = finished(job)
    assert re.search(r"WARNING skipping __0_0.distcp of the node-local copy \S+step-000000000055: xxh3_128 mismatch",
                     result.output), result.output[-4000:]
    assert "restored step 50 from the node-local tier" in result.output
    assert start_steps(result.output) == [0, 50]
    assert result.summary["params_sha256"] == ref.summary["params_sha256"]


@pytest.mark.torchrun
def test_fsdp_node_loss_restores_the_lost_nodes_shards_from_its_peers_memory_bitwise(tmp_path, reference):
    """Two agents as two nodes (one worker each), each node its own fast tier: node 1 keeps a copy of node 0's shards
    and node 0 of node 1's. Node 1 (agent and worker) is SIGKILLed in step 60 and its memory removed; relaunched with
    an empty directory, the job restores step 55 with rank 1's shards from node 0's peer copy, bitwise."""
    _, ref = reference
    (tmp_path / "trace").mkdir()
    overrides = [*FSDP, f"task.args.trace_dir={tmp_path / 'trace'}", f"run.dir={tmp_path / 'run'}",
                 f"snapshot.local.url={tmp_path}/shm-node$GROUP_RANK", *FAST, "task.args.pause_rank=1",
                 "task.args.pause_at_step=60"]
    nodes = NodeGroup(tmp_path, [*WARM, "-m", "elastictrain", "train", *overrides], nnodes="2", rdzv_conf=RDZV_CONF,
                      env={"OMP_NUM_THREADS": "1"})  # as torchrun sets it for the reference's two workers
    nodes.launch(0, host_store=True)
    nodes.launch(1, host_store=False)
    procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, nodes.agents[1])
    for node in (0, 1):  # each node: its own rank's shards and its peer's
        assert copy_files(tmp_path / f"shm-node{node}", 55) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                 "manifest.json", "state.pt"]
    nodes.kill(1)
    shutil.rmtree(tmp_path / "shm-node1")  # the lost node's memory is gone with it
    nodes.launch(1, host_store=False)
    assert nodes.wait(TIMEOUT_S * 2) == {0: 0, 1: 0}, nodes.output()[-6000:]
    output = nodes.agents[0].output()
    assert ("restored step 55 from the node-local tier: node 0's shards (ranks 0) from node 0's own copy, "
            "node 1's shards (ranks 1) from node 0's peer copy") in output, output[-4000:]
    result = parse_job(output)
    assert start_steps(output) == [0, 55] and result.summary["params_sha256"] == ref.summary["params_sha256"]
    assert nodes.leftover_pids() == []


def test_each_nodes_shards_are_kept_by_the_next_node_and_a_copy_is_whole_only_with_every_file():
    assert fast_shards.peer_ranks([0, 0, 1, 1]) == [2, 3, 0, 1]  # (r + local world) % world
    assert fast_shards.peer_ranks([0, 1, 2]) == [1, 2, 0]
    assert fast_shards.peer_ranks([0, 0, 1]) == [2, 2, 0]  # a smaller next node keeps several ranks' shards
    assert fast_shards.peer_ranks([0, 0]) == [None, None]  # one node: no peer

    def offer(step: int, files: set[str], metadata: str = "m") -> dict:
        manifest = Manifest(f"step-{step:012d}", step, 0.0, {}, {"shards": ["__0_0.distcp", "__1_0.distcp"]})
        return {(step, metadata): fast_restore.NodeOffer(frozenset(files | {".metadata", "state.pt"}), manifest)}

    node0 = {**offer(50, {"__0_0.distcp", "__1_0.distcp"}), **offer(55, {"__0_0.distcp"})}
    assert fast_restore.choose([node0, {}]) == (50, "m")  # step 55 lacks rank 1's shards
    assert fast_restore.choose([node0, offer(55, {"__1_0.distcp"})]) == (55, "m")  # together the nodes hold it
    assert fast_restore.choose([node0, offer(55, {"__1_0.distcp"}, metadata="other")]) == (50, "m")  # another save
    assert fast_restore.choose([{}, {}]) is None


@pytest.mark.parametrize("setting, key", [
    ("train.virtual_shards=2", "train.virtual_shards=0"),
    ("dist.sync_batchnorm=true", "dist.sync_batchnorm=false"),
    ("snapshot.local.async_write=true", "snapshot.local.async_write=false"),
])
def test_fsdp_with_a_setting_it_cannot_serve_is_one_line_naming_the_fix(setting, key):
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["dist.strategy=fsdp", setting])
    message = str(raised.value)
    assert "\n" not in message and "dist.strategy=fsdp cannot be combined with" in message and key in message
    load_config(None, ["dist.strategy=ddp", setting])  # the same setting with ddp is fine


def test_default_wrapping_shards_the_blocks_of_the_outermost_lists():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # a block's own list stays in the block

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 2)  # outside any list: the root's
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))

    net = Net()
    assert [id(m) for m in fsdp.blocks(net)] == [id(m) for m in [*net.blocks, net.head[0], net.head[2]]]


def test_one_process_saves_and_loads_its_shards_without_dcps_single_process_warning(tmp_path):
    """A one-worker fsdp run has no process group; DCP warned at every save and restore that it would act in one
    process, which is what such a run means. Other warnings still show."""
    import warnings

    import torch.distributed as dist

    from elastictrain.snapshot.sharded import ShardedState

    assert not dist.is_initialized()
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    sharded = ShardedState(model, [optimizer])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded.write(str(tmp_path / "step-1"), step=1)
        before = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        sharded.load(str(tmp_path / "step-1"), "the test's snapshot")
        warnings.warn("another warning", UserWarning)
    assert torch.equal(model.weight, before), "the shards load back"
    assert [str(w.message) for w in caught] == ["another warning"]
