"""elastictrain-run (elastictrain/launcher/launch.py): torchrun's arguments, exit codes a supervisor can act on.

Real torchrun agent (in the wrapper's process), real workers, a real SIGTERM to the wrapper's pid.
"""

from __future__ import annotations

import re
import signal
import sys

import pytest

from elastictrain.launcher.launch import exit_code_for
from elastictrain.storage.snapshot_store import SnapshotStore
from tests.conftest import REPO_ROOT, job_env
from tests.helpers import procs

TIMEOUT_S = 120
PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


def wrapper_command(overrides: list[str], *, max_restarts: int = 3, target: tuple[str, ...] = ("-m", "elastictrain", "train")
                    ) -> list[str]:
    """`elastictrain-run <torchrun flags> -m elastictrain train OVERRIDES` (or another target), from this interpreter."""
    return [
        sys.executable, "-m", "elastictrain.launcher.launch",
        "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "--shutdown-timeout=60",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        *target, *overrides,
    ]


@pytest.mark.torchrun
def test_sigterm_to_the_launcher_leaves_a_snapshot_and_exits_143_without_traceback(tmp_path):
    run_dir = tmp_path / "run"
    job = procs.launch(wrapper_command([f"run.dir={run_dir}", "train.max_epochs=100", "train.log_every_steps=5",
                                        "log.plots=false"]),
                       log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    job.wait_for(lambda text: re.search(r"\bstep \d+ epoch", text) is not None, TIMEOUT_S, "training under way")
    job.proc.send_signal(signal.SIGTERM)
    code = job.wait(TIMEOUT_S)
    output = job.output()
    assert code == 143, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert "elastictrain-run: SIGTERM forwarded to the workers; exiting 143" in output
    found = PREEMPTED.findall(output)
    assert len(found) == 1, output[-4000:]
    manifest, _ = SnapshotStore(str(run_dir / "snapshots")).latest_valid()
    assert manifest.step == int(found[0])
    assert job.leftover_pids() == []


ATTEMPT_FAILED = "failed (exitcode: "  # torch's agent, once for each attempt that failed (its first failed worker)


@pytest.mark.torchrun
def test_a_config_error_under_the_launcher_ends_the_first_attempt_exits_2_with_its_line_last(tmp_path):
    job = procs.launch(wrapper_command([f"run.dir={tmp_path / 'run'}", "train.max_epohcs=3"], max_restarts=10),
                       log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    code = job.wait(TIMEOUT_S)
    output = job.output()
    assert code == 2, output[-4000:]
    assert output.count(ATTEMPT_FAILED) == 1, output[-4000:]  # 10 restarts allowed; none made
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert re.fullmatch(re.escape(
        "elastictrain-run: error: invalid config (defaults + overrides): unknown key 'train.max_epohcs' (did you mean "
        "'train.max_epochs'?) (rank ") + r"\d" + re.escape(", attempt 0; no restart can fix it, so none was made); exiting 2"),
        output.rstrip().splitlines()[-1]), output[-4000:]
    assert job.leftover_pids() == []


MISUSED_LOOP = REPO_ROOT / "tests" / "helpers" / "misused_loop.py"


@pytest.mark.torchrun
@pytest.mark.parametrize("misuse, line", [
    ("steps-on-rank-0-only", "rank 1 asked the loader for the next step's micro-batches without session.step() after "
                             "the 1 it took: call session.step() on every rank, once per optimizer step (a rank that "
                             "skips it leaves the others waiting in a collective) (rank 1"),
    ("rank-0-leaves", "rank 0 left the session at step 5 before the run was done while the other ranks trained on: "
                      "every rank runs session.epochs() to its end (or all leave at the same step), calling "
                      "session.step() once per optimizer step (rank 0"),
])
def test_session_step_on_some_ranks_only_ends_the_first_attempt_with_one_line_exit_2(tmp_path, misuse, line):
    # Before: a 30 s watchdog hang with stack dumps (or a lost peer), then the same in every restart.
    job = procs.launch(wrapper_command([str(tmp_path / "run"), misuse], max_restarts=3, target=(str(MISUSED_LOOP),)),
                       log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    code = job.wait(TIMEOUT_S)
    output = job.output()
    assert code == 2, output[-4000:]
    assert output.count(ATTEMPT_FAILED) == 1, output[-4000:]
    assert "Traceback" not in output and "no progress for" not in output, output[-4000:]
    # The rank left waiting names the peer's error as the cause, not the connection it closed, and no restart.
    assert re.search(r"rank \d stopped in state TRAIN at step \d+ because rank \d stopped on a UsageError no restart "
                     r"can fix \(its line is above\)", output), output[-4000:]
    assert "lost a peer" not in output, output[-4000:]
    assert "the launcher restarts the group" not in output, output[-4000:]
    assert output.rstrip().splitlines()[-1] == (f"elastictrain-run: error: {line}, attempt 0; no restart can fix it, "
                                                "so none was made); exiting 2"), output[-4000:]
    assert job.leftover_pids() == []


def test_exit_code_for_worker_failures():
    assert exit_code_for({0: 2, 1: -15}) == 2
    assert exit_code_for({0: 1}) == 1
    assert exit_code_for({1: -9}) == 1
