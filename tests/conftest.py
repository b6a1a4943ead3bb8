"""Shared fixtures: every process a test starts is reaped; torchrun jobs are launched one way."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import procs

REPO_ROOT = Path(__file__).resolve().parent.parent

pytest_plugins = ["tests.helpers.s3"]  # s3_server, s3_bucket: a real SeaweedFS S3 server


# Fixtures that start a server or a job: a test using one is slow, whatever its own body does.
SLOW_FIXTURES = {
    "s3_server", "s3_bucket",  # SeaweedFS (tests/helpers/s3.py)
    "prometheus_path",  # a real Prometheus server (tests/test_metrics.py)
    "cluster",  # SLURM: slurmctld, slurmd, munged (tests/test_launch_slurm.py)
    "reference_run", "elastic_run",  # torchrun jobs shared by a session or a module
}


# Their tests install Debian packages (apt-get takes one at a time) or start the machine's one slurmctld.
DEBIAN_SERVER_MODULES = {"test_elastic", "test_launch_slurm", "test_metrics", "test_launch_monitoring"}
# Their tests share a module fixture that trains or builds (a trained store, the built site): one worker runs
# them all, so it is made once. test_chaos: its one test mounts tmpfs and pauses its worker's S3 server for seconds.
ONE_WORKER_MODULES = {"test_snapshot_cli", "test_docs", "test_self_healing", "test_tracking", "test_chaos"}
# Their parametrized tests share a module fixture per parameter (test_examples: each example's unbroken run):
# one worker runs the tests of one parameter.
ONE_WORKER_PER_PARAM_MODULES = {"test_examples"}
# The longest groups above, longest first, are handed out first (xdist hands out work in collection order: a
# chain of minutes collected last runs on one worker while the others are done). Test time in CI on 2 cores:
# debian-servers ~350 s, test_self_healing ~250 s, test_tracking ~160-200 s, test_chaos ~160 s.
LONG_GROUPS_FIRST = ("debian-servers", "tests/test_self_healing.py", "tests/test_tracking.py", "tests/test_chaos.py")
# Then the tests of these files (node id prefixes), in this order: each of their tests takes 20-75 s in CI (mypy's
# first run ~50 s), so the short tests collected before them would otherwise leave a minute's test to start last.
LONG_TESTS_NEXT = (
    "tests/test_fsdp.py", "tests/test_types.py::test_the_package_type_checks", "tests/test_examples.py",
    "tests/test_run_identity.py", "tests/test_thread_pinning.py", "tests/faults/", "tests/test_fail_fast.py",
    "tests/test_resume.py", "tests/test_launch_torchrun.py", "tests/test_main_job.py",
)


def xdist_group(nodeid: str) -> str:
    """The pytest-xdist work unit a test belongs to: the tests of one group run on one worker, in turn.

    A test of none of the groups above is a unit of its own (any worker takes it). An `xdist_group` mark counts
    where xdist could add it to the node id (`...@name`, with pytest before 9): put a new group in the sets above."""
    if "@" in nodeid.rsplit("]", 1)[-1]:
        return nodeid.rsplit("@", 1)[1]
    path, _, rest = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    if module in DEBIAN_SERVER_MODULES:
        return "debian-servers"
    if module in ONE_WORKER_MODULES:
        return path
    if module in ONE_WORKER_PER_PARAM_MODULES and rest.endswith("]"):
        return path + "[" + rest.split("[", 1)[1]
    return nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups of xdist_group() above, read from node ids by the controller.

    xdist's own loadgroup reads `xdist_group` marks, which workers pass on by renaming each test's node id;
    pytest 9 keeps the id elsewhere, so under pytest 9.2 and xdist 3.8 every mark was silently dropped and a
    group's tests ran on both workers at once (two SLURM clusters on one machine's ports)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return Groups(config, log)


def pytest_collection_modifyitems(items):
    """Tiers: a test is `slow` when it starts processes or servers, or trains for seconds in this process (its
    `torchrun` or `slow` marker, or a fixture of SLOW_FIXTURES); every other test is `fast`. `python -m pytest
    -m fast` runs the fast tier alone; `python -m pytest` (.ci/run) runs every tier. A `cuda` test is slow, and
    skipped with one reason where no GPU is present; `python -m pytest -m cuda` runs the GPU tier alone."""
    no_gpu = None
    for item in items:
        if item.get_closest_marker("cuda"):
            if no_gpu is None:
                from tests.helpers.devices import cuda_available

                no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); the GPU tier: "
                                                 "benchmarks/gpu/run_all.sh") if not cuda_available() else False
            if no_gpu:
                item.add_marker(no_gpu)
            item.add_marker(pytest.mark.slow)  # never in the fast tier: it needs a GPU and starts CUDA
        if item.get_closest_marker("torchrun") or not SLOW_FIXTURES.isdisjoint(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)
    items.sort(key=first_handed_out)


def first_handed_out(item) -> int:
    """Sort key: the long groups first (LONG_GROUPS_FIRST), then the long tests (LONG_TESTS_NEXT), every other test
    after them in collection order."""
    group = xdist_group(item.nodeid)
    if group in LONG_GROUPS_FIRST:
        return LONG_GROUPS_FIRST.index(group)
    for index, prefix in enumerate(LONG_TESTS_NEXT):
        if item.nodeid.startswith(prefix):
            return len(LONG_GROUPS_FIRST) + index
    return len(LONG_GROUPS_FIRST) + len(LONG_TESTS_NEXT)


@pytest.fixture(autouse=True)
def _reap():
    yield from procs.reap_fixture()


def torchrun_launcher(*, nproc: int = 2, max_restarts: int = 3) -> list[str]:
    """The torchrun part of the launch line users type: c10d rendezvous, 2 workers, restarts."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
    ]


# Before the script on torchrun's line: restarted workers are forked from a preloaded interpreter
# (elastictrain/launcher/warmstart.py). The suite's restart-heavy tests run so: a cold restart costs its two
# workers ~8.6 s of CPU importing torch, and the suite is mostly process starts on two cores. Tests
# whose subject is how a worker starts (the launch recipes, the examples as users type them, the
# main job, thread pinning, fail-fast) run cold.
WARM = ["-m", "elastictrain.launcher.warmstart"]


def torchrun_command(overrides: list[str], *, nproc: int = 2, max_restarts: int = 3, warmstart: bool = False) -> list[str]:
    """`torchrun ... [-m elastictrain.launcher.warmstart] -m elastictrain train OVERRIDES`, as a list."""
    warm = WARM if warmstart else []
    return [*torchrun_launcher(nproc=nproc, max_restarts=max_restarts), *warm, "-m", "elastictrain", "train", *overrides]


def python_command(overrides: list[str]) -> list[str]:
    """`python -m elastictrain train OVERRIDES`: one process, no launcher."""
    return [sys.executable, "-m", "elastictrain", "train", *overrides]


def job_env() -> dict[str, str]:
    # Workers import the test tasks (tests.helpers.tasks) from the repository root.
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


@dataclass
class JobResult:
    output: str
    summary: dict[str, str]
    restored_steps: list[int]


SUMMARY = re.compile(r"run summary: (.*)$", re.MULTILINE)
RESTORED = re.compile(r"restored snapshot \S+: step (\d+)")


def parse_job(output: str) -> JobResult:
    found = SUMMARY.findall(output)
    assert found, "no run summary line in the output:\n" + output[-4000:]
    summary = dict(item.split("=", 1) for item in found[-1].split())
    return JobResult(output, summary, [int(s) for s in RESTORED.findall(output)])


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """One unbroken run of the traced test job (tests/helpers/jobs.py): what every faulted run must equal.

    Run once per suite, not once per pytest-xdist worker: the first worker to ask runs it in the
    directory the workers share, the others wait for it and read what it left (tests/helpers/jobs.py)."""
    from tests.helpers.jobs import shared_reference

    if "PYTEST_XDIST_WORKER" not in os.environ:  # no xdist: this process is the only one that asks
        return shared_reference(tmp_path_factory.mktemp("reference"))
    return shared_reference(tmp_path_factory.getbasetemp().parent / "reference")
