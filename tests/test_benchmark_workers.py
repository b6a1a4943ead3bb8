"""The goodput benchmark's worker still runs against the library, and its harness still reads what it prints.

``benchmarks/goodput.py`` takes 15-50 minutes, so nothing else runs it: once, a library change (the
goodput counters moved from ``Trainer`` to ``trainer.session.state``) broke its worker unnoticed
until the next measurement. Here each loop of ``benchmarks/_goodput_worker.py`` trains three steps in
one process (rank 0 of 1, as torchrun would set it), and the benchmark's own parser
(``benchmarks/_goodput_timeline.py``) must find every mark the goodput accounting reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT, job_env
from tests.helpers.agents import free_port

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import _goodput_timeline as timeline  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = REPO_ROOT / "benchmarks" / "_goodput_worker.py"


def run_worker(tmp_path, loop: str, extra: list[str]) -> tuple[str, float]:
    env = {**job_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    (tmp_path / "work").mkdir()  # the harness makes each job's directory
    launched = time.time()
    done = subprocess.run([sys.executable, str(WORKER), f"--loop={loop}", f"--workdir={tmp_path / 'work'}",
                           "--epochs=1", "--epoch-steps=3", *extra],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr, launched


def test_the_elastictrain_worker_prints_every_mark_the_goodput_accounting_reads(tmp_path):
    fast = str(tmp_path / "shm")
    config = {"snapshot": {"local": {"url": fast, "every_s": "auto"}, "durable": {"async_write": True}}}
    output, launched = run_worker(tmp_path, "elastictrain", [f"--config={json.dumps(config)}"])
    parsed = timeline.parse(output, launched, fast)

    attempt = parsed.attempts[0]
    # (its "process group gloo up" line, the accounting's "pg" mark, comes with two ranks: one has no group)
    assert {"exec", "imported", "group", "restored", "done"} <= set(attempt.events), attempt.events
    assert [step for step, _ in attempt.steps] == [1, 2, 3]
    assert attempt.restored_step == 0 and attempt.done_step == 3
    assert parsed.goodput_counter is not None and 0 < parsed.goodput_counter["ratio"] <= 1
    assert {"productive", "snapshot", "restore", "restart"} <= set(parsed.goodput_counter["seconds_by_cause"])
    assert parsed.summary_line is not None and "state=DONE step=3" in parsed.summary_line
    assert {commit["tier"] for commit in parsed.commits} == {"durable", "node-local"}
    assert attempt.snapshots, "the final snapshot's blocked time"
    assert parsed.restores == {"node-local": 0, "survivor copy": 0, "durable": 0, "fresh": 0}


def test_the_textbook_worker_prints_its_marks_and_its_checkpoints(tmp_path):
    output, launched = run_worker(tmp_path, "textbook", [])
    attempt = timeline.parse(output, launched).attempts[0]
    assert {"exec", "imported", "pg", "group", "restored", "done"} <= set(attempt.events), attempt.events
    assert [step for step, _ in attempt.steps] == [1, 2, 3] and attempt.done_step == 3
    assert [step for step, _ in attempt.snapshots] == [3], "the epoch's checkpoint"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_gpu_snapshot_benchmark_measures_every_mode_tiny(tmp_path, device):
    """benchmarks/gpu_snapshot.py with a 1e6-parameter model: every mode snapshots at the steps asked, the state
    it writes is the weights and Adam's two moments (12 bytes a parameter), and each blocked time is measured."""
    out = tmp_path / "gpu_snapshot.json"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_snapshot.py"), "--device", device,
                           "--params", "1e6", "--steps", "12", "--every", "4", "--batch", "32", "--dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, env={**job_env(), "OMP_NUM_THREADS": "1"},
                          cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["off", "durable_async", "fast_tier", "dcp"]
    assert abs(report["params"] - 1e6) < 0.05e6
    assert results["off"]["snapshots"] == 0
    # The node-local tier takes no copy at the end of the run (durable's step 12 is the run's last step).
    expected_steps = {"durable_async": [4, 8, 12], "fast_tier": [4, 8], "dcp": [4, 8, 12]}
    for mode, steps in expected_steps.items():
        result = results[mode]
        assert result["snapshot_steps"] == steps, (mode, result)
        assert 12 * report["params"] <= result["snapshot_bytes"] <= 12.5 * report["params"], (mode, result)
        assert len(result["blocked_s"]) == len(steps) and all(0 < b < 60 for b in result["blocked_s"]), (mode, result)
        assert len(result["at_snapshot_step_s"]) == len(steps) and result["baseline_steps"] >= 1
    assert "results: " + str(out) in done.stdout
    assert [line.split()[0] for line in done.stdout.splitlines() if line.split()[:1] and line.split()[0] in results] == \
        list(results)  # the table: one row a mode
