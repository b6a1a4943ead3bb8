"""elastictrain-run (elastictrain/launch.py): torchrun's arguments, exit codes a supervisor can act on.

Real torchrun agent (in the wrapper's process), real workers, a real SIGTERM to the wrapper's pid.
"""

from __future__ import annotations

import re
import signal
import sys

import pytest

from elastictrain.launch import exit_code_for
from elastictrain.storage import SnapshotStore
from tests.conftest import job_env
from tests.helpers import procs

TIMEOUT_S = 120
PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


def wrapper_command(overrides: list[str], *, max_restarts: int = 3) -> list[str]:
    """`elastictrain-run <torchrun flags> -m elastictrain train OVERRIDES`, from this interpreter."""
    return [
        sys.executable, "-m", "elastictrain.launch",
        "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.1", "--shutdown-timeout=60",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "-m", "elastictrain", "train", *overrides,
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


ATTEMPT_FAILED = "will restart worker group"  # torch's agent, before each restart


@pytest.mark.torchrun
def test_a_config_error_under_the_launcher_ends_the_first_attempt_exits_2_with_its_line_last(tmp_path):
    job = procs.launch(wrapper_command([f"run.dir={tmp_path / 'run'}", "train.max_epohcs=3"], max_restarts=10),
                       log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    code = job.wait(TIMEOUT_S)
    output = job.output()
    assert code == 2, output[-4000:]
    assert output.count(ATTEMPT_FAILED) == 0, output[-4000:]  # 10 restarts allowed; none made
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert re.fullmatch(re.escape(
        "elastictrain-run: error: invalid config (defaults + overrides): unknown key 'train.max_epohcs' (did you mean "
        "'train.max_epochs'?) (rank ") + r"\d" + re.escape(", attempt 0; no restart can fix it, so none was made); exiting 2"),
        output.rstrip().splitlines()[-1]), output[-4000:]
    assert job.leftover_pids() == []


def test_exit_code_for_worker_failures():
    assert exit_code_for({0: 2, 1: -15}) == 2
    assert exit_code_for({0: 1}) == 1
    assert exit_code_for({1: -9}) == 1
