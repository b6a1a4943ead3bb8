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
