"""A fast tier or a run.dir that cannot be written stops the job at start-up: one line naming the key, no restart.

Real torchrun, 2 workers, one restart allowed: one rank of attempt 0 says what is wrong; attempt 1
stops at once, silently, instead of repeating it (a restart cannot make a path writable).
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.jobs import TIMEOUT_S, launch_job

pytestmark = pytest.mark.torchrun


def worker_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "[elastictrain r" in line]


def assert_stopped_once_without_restart(output: str, error: str) -> None:
    lines = worker_lines(output)
    stopped = [line for line in lines if re.search(r"a0\] ERROR rank \d stopped in state \w+ at step 0: ", line)]
    assert len(stopped) == 1 and error in stopped[0], "\n".join(lines[-40:])  # one rank says it, once
    # torchrun restarts the group whatever the exit code; the restart finds the recorded error and
    # leaves before it imports torch, without a word (elastictrain/core/fatal.py).
    assert not any(" a1] " in line for line in lines), "the restart did nothing but stop, silently"
    raw = [line for line in output.splitlines() if "Not a directory" in line and error not in line]
    assert raw == [], "no raw OSError besides the one line"
    assert not any(" step 1" in line or "TRAIN" in line for line in lines), "no step was trained"


@pytest.mark.parametrize("survivor_copies", ["true", "false"])
def test_an_unwritable_fast_tier_is_one_line_naming_its_key_and_no_restart(tmp_path, survivor_copies):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    job = launch_job(tmp_path, "job", [f"snapshot.local.url={blocker / 'shm'}", f"snapshot.local.survivor_copies={survivor_copies}"],
                     max_restarts=1)
    assert job.wait(TIMEOUT_S) != 0
    output = job.output()
    assert_stopped_once_without_restart(output, f"snapshot.local.url={blocker / 'shm'} cannot be used on this node")
    assert "snapshot.durable.url" not in "\n".join(worker_lines(output)), "the warnings and errors name the key that is wrong"


def test_an_unwritable_run_dir_with_log_jsonl_is_one_line_naming_it_and_no_restart(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    job = launch_job(tmp_path, "job", [f"run.dir={blocker / 'run'}", f"snapshot.durable.url={tmp_path / 'snapshots'}",
                                       "log.jsonl=true"], max_restarts=1)
    assert job.wait(TIMEOUT_S) != 0
    output = job.output()
    assert_stopped_once_without_restart(output, f"log.jsonl=true but {blocker / 'run' / 'log.jsonl'} cannot be written")
