"""The traced test job under real torchrun, shared by the resume and fault tests.

One uninterrupted run of it is the reference (a session fixture in tests/conftest.py): every
faulted run must end with the same params_sha256 and, stitched at the step each attempt
restored, the very same samples on each rank in the same order.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from tests.conftest import job_env, parse_job, python_command, torchrun_command, JobResult
from tests.helpers import procs
from tests.helpers.tasks import read_traces

SNAPSHOT_EVERY = 25
STEPS_PER_EPOCH = 48
# 1536 samples / (16 per rank x 2 ranks) = 48 steps an epoch; 5 epochs = 240 steps.
JOB = [
    "task.factory=tests.helpers.tasks:build",
    "train.max_epochs=5",
    "train.batch_size=16",
    "train.log_every_steps=10",
    f"snapshot.durable.every_steps={SNAPSHOT_EVERY}",
    # 509 validation samples in batches of 100: uneven shards and a short last batch per rank.
    "task.args.val_samples=509",
    "data.val_batch_size=100",
    # No end-of-run plots (tests/test_plots.py covers them): matplotlib at DONE costs every completed run ~1.5 s.
    "log.plots=false",
]
TIMEOUT_S = 120
# Single processes run side by side on two cores: one intra-op thread each, as torchrun gives its
# workers (bitwise comparisons need equal thread counts).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ATTEMPT_START = re.compile(r"\[elastictrain r0 a(\d+)\] INFO (?:restored snapshot \S+: step (\d+)|no snapshot at)")


def start_steps(output: str) -> list[int]:
    """The step each attempt began at (0 for a fresh start), in attempt order."""
    return [int(step or 0) for _, step in ATTEMPT_START.findall(output)]


def launch_job(workdir: Path, name: str, extra: list[str] = (), single_process: bool = False,
               env: dict[str, str] | None = None, max_restarts: int = 3, warmstart: bool = True) -> procs.Launched:
    """The traced job under torchrun (or one process), with warm restarts unless ``warmstart=False``
    (tests/conftest.py's WARM says why)."""
    overrides = [*JOB, f"task.args.trace_dir={workdir / 'trace'}", f"run.dir={workdir / 'run'}", *extra]
    (workdir / "trace").mkdir(exist_ok=True)
    command = (python_command(overrides) if single_process
               else torchrun_command(overrides, max_restarts=max_restarts, warmstart=warmstart))
    return procs.launch(command, log_path=workdir / f"{name}.log", env={**job_env(), **(env or {})}, cwd=workdir)


def variant_reference(variant, request) -> Reference:
    """The unbroken run of ``variant`` (tests/helpers/devices.py): the suite's reference for the plain CPU one, one run
    per other variant (made by the first test that asks, shared as the CPU one is)."""
    if not variant.overrides:
        return request.getfixturevalue("reference_run")
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent
    return shared_reference(base / f"reference-{variant.name}", variant.overrides)


@dataclass
class Reference:
    result: JobResult
    traces: dict[int, list[list[int]]]  # rank -> sample indices of every step
    workdir: Path


def run_reference(workdir: Path, extra: tuple[str, ...] = ()) -> Reference:
    job = launch_job(workdir, "job", list(extra))
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    procs.kill_all_launched()
    traces = {rank: read_traces(workdir / "trace", rank) for rank in (0, 1)}
    assert all(len(t) == 1 for t in traces.values())
    return Reference(parse_job(job.output()), {rank: t[0] for rank, t in traces.items()}, workdir)


def shared_reference(workdir: Path, extra: tuple[str, ...] = ()) -> Reference:
    """The reference run in ``workdir`` (with the ``extra`` overrides of a device variant, tests/helpers/devices.py),
    run by the first process to ask; later ones (other xdist workers) read it.

    The lock is held for the whole run, so a second asker waits for the first one's job instead of
    starting its own. A run that failed left no result: the next asker runs it again, in a directory of
    its own (a failed run's snapshots must not be resumed), and fails the same way.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = workdir / "reference.pickle"
    with FileLock(str(workdir / "reference.lock")):
        if result_path.exists():
            return pickle.loads(result_path.read_bytes())
        reference = run_reference(Path(tempfile.mkdtemp(prefix="run-", dir=workdir)), extra)
        result_path.write_bytes(pickle.dumps(reference))
        return reference
