"""launch/slurm on a real one-node SLURM cluster (slurmctld, slurmd, munged) that the tests bring up.

Template (b), plain srun with one task per worker, trains the default job to the end at a world
size taken from SLURM_* variables. A job preempted with ``scancel --signal=TERM`` leaves a
snapshot and exits 143, and the same command submitted again finishes with no lost step and
the parameters of the unbroken run; with ``preempt.requeue=true`` a job sent USR1 requeues
itself and finishes the same way.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastictrain.launcher.launch_env import SLURM_PORT_BASE, SLURM_PORT_SPAN, slurm_job_port
from elastictrain.storage.snapshot_store import SnapshotStore
from tests.conftest import REPO_ROOT, JobResult, parse_job
from tests.helpers.slurm import Job, SlurmCluster, SlurmUnavailable, ensure_installed
from tests.test_launch_torchrun import expected_steps

MULTI_NODE_SRUN = REPO_ROOT / "launch" / "slurm" / "multi_node_srun.sbatch"
ONE_NODE_CPU = REPO_ROOT / "launch" / "slurm" / "one_node_cpu.sbatch"
JOB_TIMEOUT_S = 120
WORLD_SIZE = 2
# The default job, shortened; log every 10 steps so a preemption can be aimed mid-run.
OVERRIDES = ["train.max_epochs=2", "train.log_every_steps=10", "snapshot.durable.every_steps=50"]
# The template asks for 2 nodes x 8 GPUs; this cluster is one node with 2 CPUs. sbatch's
# options override the template's #SBATCH lines; nothing in the file is edited.
ONE_NODE_TWO_TASKS = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--mem=1G"]
PREEMPTED_AT = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")
PROGRESS = r"\bstep (\d+) epoch \d+"


TEMPLATES = sorted((REPO_ROOT / "launch" / "slurm").glob("*.sbatch"))
# Linux's default ip_local_port_range: the kernel takes ports for outgoing connections from it, so a
# listener there may find its port taken by some connection of the node.
EPHEMERAL_PORTS_START = 32768
TORCHRUN_DEFAULT_PORTS = {29400, 29500}  # --rdzv-endpoint's and MASTER_PORT's defaults


def test_the_job_port_stays_below_the_ephemeral_range_and_every_template_derives_it_alike():
    ports = {slurm_job_port(job_id) for job_id in range(3 * SLURM_PORT_SPAN)}
    assert min(ports) > 1024 and max(ports) < EPHEMERAL_PORTS_START
    assert ports.isdisjoint(TORCHRUN_DEFAULT_PORTS)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert max(ports) < low, f"this machine's ephemeral ports start at {low}"
    # Template (c) computes the rendezvous port in bash; template (b) leaves it to elastictrain (launch_env).
    derived = [re.findall(r"\$\(\((\d+) \+ SLURM_JOB_ID % (\d+)\)\)", path.read_text()) for path in TEMPLATES]
    assert [d for d in derived if d] == [[(str(SLURM_PORT_BASE), str(SLURM_PORT_SPAN))]]


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_every_template_asks_for_memory(path):
    assert re.search(r"^#SBATCH --mem=\d+[KMGT]?$", path.read_text(), re.M), f"{path.name}: no #SBATCH --mem"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        install_s = ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(f"no SLURM here: {exc}")
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        start_s = slurm.start()
        print(f"\nSLURM: apt install {install_s:.1f} s (0: already installed), cluster up in {start_s:.1f} s")
        yield slurm
    finally:
        survivors = slurm.stop()
    assert not survivors, f"SLURM processes still alive after stop(): {survivors}"


@dataclass
class SlurmRun:
    job: Job
    info: dict[str, str]
    wall_s: float

    @property
    def result(self) -> JobResult:
        return parse_job(self.job.output())


def submit(cluster: SlurmCluster, work_dir: Path, name: str, extra: list[str] = ()) -> Job:
    """Submit template (b) unchanged: 2 tasks, the default job, run directory in work_dir."""
    work_dir.mkdir(parents=True, exist_ok=True)
    env = {
        # The template runs `python`: the interpreter of these tests, with this checkout importable.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    return cluster.sbatch(
        MULTI_NODE_SRUN, [f"run.dir={work_dir / 'run'}", *OVERRIDES, *extra],
        options=[*ONE_NODE_TWO_TASKS, f"--job-name={name}", f"--chdir={work_dir}"],
        env=env, output_path=work_dir / f"{name}.out",
    )


def run_to_end(cluster: SlurmCluster, job: Job) -> SlurmRun:
    started = time.monotonic()
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    return SlurmRun(job, info, time.monotonic() - started)


@pytest.fixture(scope="module")
def unbroken(cluster, tmp_path_factory) -> SlurmRun:
    run = run_to_end(cluster, submit(cluster, tmp_path_factory.mktemp("unbroken"), "unbroken"))
    print(f"\nSLURM job {run.job.job_id}: submitted to {run.info['JobState']} in {run.wall_s:.1f} s (RunTime {run.info['RunTime']})")
    return run


def test_srun_template_trains_the_default_job_at_world_size_from_slurm(unbroken):
    assert (unbroken.info["JobState"], unbroken.info["ExitCode"]) == ("COMPLETED", "0:0"), unbroken.job.output()[-4000:]
    output = unbroken.job.output()
    assert "launcher slurm" in output, "rank and world size must come from SLURM_* variables"
    summary = unbroken.result.summary
    assert summary["state"] == "DONE"
    assert summary["world_size"] == str(WORLD_SIZE)
    assert int(summary["step"]) == expected_steps(OVERRIDES, WORLD_SIZE)
    assert re.fullmatch(r"[0-9a-f]{64}", summary["params_sha256"])


def test_preempted_job_exits_143_and_the_same_command_resumes_with_no_lost_step(cluster, unbroken, tmp_path):
    job = submit(cluster, tmp_path, "preempted", ["preempt.requeue=false"])  # the template passes true
    stopped_step = preempt_with_term(cluster, job, tmp_path / "run")

    again = run_to_end(cluster, submit(cluster, tmp_path, "resumed"))
    assert (again.info["JobState"], again.info["ExitCode"]) == ("COMPLETED", "0:0"), again.job.output()[-4000:]
    assert_resumed_without_loss(again.result, stopped_step, unbroken)


def test_preempted_job_requeues_itself_by_default_and_finishes(cluster, unbroken, tmp_path):
    """The template passes preempt.requeue=true: the time-limit USR1 brings the job back (#SBATCH --requeue alone does not)."""
    job = submit(cluster, tmp_path, "requeued")
    cluster.wait_output(job, PROGRESS, JOB_TIMEOUT_S)
    cluster.scancel(job, "--signal=USR1")  # what --signal=USR1@120 sends before the time limit
    cluster.start_requeued_now(job, JOB_TIMEOUT_S)
    info = run_to_end(cluster, job).info
    output = job.output()  # --open-mode=append: both attempts
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert info["Restarts"] == "1", "the job put itself back in the queue once"
    assert_resumed_without_loss(parse_job(output), preempted_step(output), unbroken)


def test_cpu_template_under_elastictrain_run_exits_143_after_a_preemption(cluster, tmp_path):
    """Template (a, CPU): torchrun's agent in one task; elastictrain-run makes the job's exit 143, not torchrun's 1."""
    bin_dir = tmp_path / "bin"  # the console script, as `pip install` would put it beside python
    bin_dir.mkdir()
    (bin_dir / "elastictrain-run").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m elastictrain.launcher.launch "$@"\n')
    (bin_dir / "elastictrain-run").chmod(0o755)
    env = {
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "NPROC_PER_NODE": str(WORLD_SIZE),
    }
    job = cluster.sbatch(ONE_NODE_CPU, [f"run.dir={tmp_path / 'run'}", *OVERRIDES, "preempt.requeue=false"],
                         options=["--job-name=cpu", f"--chdir={tmp_path}"], env=env, output_path=tmp_path / "cpu.out")
    preempt_with_term(cluster, job, tmp_path / "run")
    assert "Traceback" not in job.output(), job.output()[-4000:]


def preempt_with_term(cluster: SlurmCluster, job: Job, run_dir: Path) -> int:
    """Once the job trains, send what `scancel` and a preemption send (TERM to every task of the job's steps);
    the job must exit 143 with its preemption snapshot the newest valid one. Returns the step it stopped at."""
    cluster.wait_output(job, PROGRESS, JOB_TIMEOUT_S)
    cluster.scancel(job, "--signal=TERM")
    info = cluster.wait_job(job, JOB_TIMEOUT_S)
    output = job.output()
    assert "run summary: state=DONE" not in output, "the signal came after the job had finished; aim it earlier"
    assert info["ExitCode"] == "143:0", f"{info['JobState']} {info['ExitCode']}\n{output[-4000:]}"
    stopped_step = preempted_step(output)
    manifest, _ = SnapshotStore(str(run_dir / "snapshots")).latest_valid()
    assert manifest.step == stopped_step, "the preemption snapshot is the newest valid one"
    return stopped_step


def preempted_step(output: str) -> int:
    found = PREEMPTED_AT.findall(output)
    assert len(found) == 1, f"expected one preemption, found {found}\n{output[-4000:]}"
    return int(found[0])


def assert_resumed_without_loss(result: JobResult, stopped_step: int, unbroken: SlurmRun) -> None:
    assert result.restored_steps == [stopped_step], "resumed exactly where the preempted job stopped"
    assert result.summary["state"] == "DONE"
    assert result.summary["step"] == unbroken.result.summary["step"]
    assert result.summary["params_sha256"] == unbroken.result.summary["params_sha256"], "no step lost or repeated"
