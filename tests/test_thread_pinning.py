"""Thread pinning under real torchrun: the bits do not depend on how a worker was launched.

The test task's loss is scaled by a mean of 2M squares, a sum that the intra-op threads split, so
its last bits, and the whole run's, change with the thread count: an unpinned 1-worker run (two
threads) ends with other parameters than the 2-worker runs (torchrun gives each of several workers
one thread). No test here sets OMP_NUM_THREADS: the launcher decides, as it does for users.

- 2 workers, preempted -> 1 worker, preempted -> 2 workers ends bitwise equal to an unbroken
  2-worker run (the bitwise-elastic mode): the 1-worker attempt computes with the run's one thread.
- A 1-worker run with both cores busy (two spinning processes the test starts and kills by pid)
  ends bitwise equal to the same run on an idle machine (8 steps: the bits of every loss call depend
  on the thread count).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import job_env, parse_job, torchrun_command
from tests.helpers import procs
from tests.helpers.tasks import _BIG

pytestmark = pytest.mark.torchrun

TIMEOUT_S = 180
# 1536 samples, a global batch of 4 virtual shards x 16 = 64: 24 steps an epoch, 48 in all.
JOB = [
    "task.factory=tests.helpers.tasks:build",
    "task.args.thread_sensitive=true",
    "train.max_epochs=2",
    "train.virtual_shards=4",
    "train.batch_size=16",
    "train.log_every_steps=8",
    "snapshot.durable.every_steps=10",
    "log.plots=false",
]
# Rank 0 pauses in its 16th and its 60th loss call, once each per job, so every launch has the same config.
PAUSES = "task.args.pauses=[[0,16],[0,60]]"
PINNED = "threads pinned for bitwise results: 1 intra-op thread"


@pytest.fixture(autouse=True)
def _launcher_decides_the_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def launch(workdir: Path, name: str, nproc: int, extra: list[str] = ()) -> procs.Launched:
    (workdir / "trace").mkdir(parents=True, exist_ok=True)
    overrides = [*JOB, f"task.args.trace_dir={workdir / 'trace'}", f"run.dir={workdir / 'run'}", *extra]
    return procs.launch(torchrun_command(overrides, nproc=nproc, max_restarts=0),
                        log_path=workdir / f"{name}.log", env=job_env(), cwd=workdir)


def run_to_end(workdir: Path, name: str, nproc: int, extra: list[str] = ()) -> dict[str, str]:
    job = launch(workdir, name, nproc, extra)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    return parse_job(job.output()).summary


def preempt_at(workdir: Path, name: str, nproc: int, call: int) -> str:
    """Launch, wait until rank 0 pauses in its ``call``-th loss call, SIGTERM the agent, let the step end."""
    job = launch(workdir, name, nproc, [PAUSES])
    marker = workdir / "trace" / f"paused-rank0-call{call}.pid"
    procs.wait_for_file(marker, TIMEOUT_S, job)
    os.kill(job.proc.pid, signal.SIGTERM)
    marker.with_suffix(".resume").touch()
    job.wait(TIMEOUT_S)
    output = job.output()
    assert "snapshot committed, exiting with code 143" in output, output[-4000:]
    return output


def test_2_then_1_then_2_workers_end_bitwise_equal_to_an_unbroken_run(tmp_path):
    reference = run_to_end(tmp_path / "reference", "reference", nproc=2)
    relaunched = tmp_path / "relaunched"
    first = preempt_at(relaunched, "first", nproc=2, call=16)  # two shards a rank a step: near step 8
    assert PINNED in first and "count: this start's, recorded for the run" in first
    # torchrun sets OMP_NUM_THREADS=1 only for several workers per node: alone, this worker would have two.
    alone = preempt_at(relaunched, "alone", nproc=1, call=60)  # four shards a step: some 15 steps on
    assert "world size 2 -> 1" in alone or "this run has 1" in alone, alone[-3000:]
    assert PINNED in alone and "count: the run's, recorded at its first start" in alone
    last = run_to_end(relaunched, "last", nproc=2, extra=[PAUSES])
    assert (last["step"], last["attempts"]) == ("48", "3")
    assert last["params_sha256"] == reference["params_sha256"]


def test_one_worker_on_busy_cores_ends_bitwise_equal_to_one_on_idle_cores(tmp_path):
    # 8 steps of 4 shards: 32 loss calls, each of whose bits depends on the thread count it ran with (the
    # test below); the job's other 40 steps, slowed by the spinners, proved nothing more.
    short = ["train.max_steps=8"]
    idle = run_to_end(tmp_path / "idle", "idle", nproc=1, extra=short)
    with procs.cpu_burners(2):
        busy = run_to_end(tmp_path / "busy", "busy", nproc=1, extra=short)
    assert idle["step"] == busy["step"] == "8"
    assert idle["params_sha256"] == busy["params_sha256"]


def test_the_task_notices_the_thread_count():
    """Without this the tests above could not fail: the job's loss scale has other bits at 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        means = []
        for count in (1, 2):
            torch.set_num_threads(count)
            means.append(_BIG.pow(2).mean())
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(means[0], means[1])
