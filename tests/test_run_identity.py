"""A node-local copy belongs to exactly one run: the one whose durable store holds its id.

Under real torchrun: run A is crashed with the fast tier on (a real SIGKILL; its survivor copy
stays in node memory), then run B starts with the same run.name and snapshot.local.url but a durable
store of its own. B must start fresh and end bitwise where an unbroken run ends, and A, launched
again, must still restore its own copy and end bitwise, with the samples of the unbroken run.

A's crash is also the survivor-copy case of a worker killed once its gradients reached its peer, which
finishes the step: rank 1's slot, written before its last backward, already names step 138, so the
copy is of step 138. Written after the all-reduce, as it was, the slot named 137 and no copy was
written (2 of 17 kills in benchmarks/goodput.py). tests/test_resume.py covers the kill inside the
forward pass, restored by a torchrun restart.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.jobs import TIMEOUT_S, launch_job, start_steps
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun

KILL_STEP = 138


def fast_copies(shm) -> list[str]:
    """Every committed node-local copy under ``shm``, as ``<run.name>/.../step-N`` paths."""
    return sorted(str(manifest.parent.relative_to(shm)) for manifest in shm.rglob("manifest.json"))


def test_a_crashed_runs_node_local_copy_is_never_restored_into_another_run_of_the_same_name(tmp_path, reference_run):
    shm = tmp_path / "shm"
    fast = [f"snapshot.local.url={shm}"]
    # Run A: rank 1 stops once step 138's gradients are in and is SIGKILLed; rank 0, its node's survivor, writes a
    # copy of step 138 to node memory. No restart: the copy is what a crashed run leaves behind.
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    run_a = launch_job(tmp_path, "a", [f"run.dir={tmp_path / 'run-a'}", *fast], max_restarts=0,
                       env={"ELASTICTRAIN_FAILPOINT": f"optimizer-step@{KILL_STEP}:{failpoints}",
                            "ELASTICTRAIN_FAILPOINT_RANK": "1"})
    os.kill(int(procs.wait_for_file(failpoints / "failpoint-optimizer-step.pid", TIMEOUT_S, run_a)), signal.SIGKILL)
    assert run_a.wait(TIMEOUT_S) != 0
    assert f"WARNING survivor copy of step {KILL_STEP} written to " in run_a.output(), run_a.output()[-4000:]
    assert start_steps(run_a.output()) == [0]
    left_by_a = fast_copies(shm)
    assert any(path.endswith(f"step-{KILL_STEP:012d}") for path in left_by_a), left_by_a

    # Run B: the same config and run.name, a new run.dir (an empty durable store): it starts fresh.
    (tmp_path / "b").mkdir()  # B's own traces
    run_b = launch_job(tmp_path / "b", "b", [f"run.dir={tmp_path / 'run-b'}", *fast])
    assert run_b.wait(TIMEOUT_S) == 0, run_b.output()[-4000:]
    result = parse_job(run_b.output())
    assert start_steps(result.output) == [0], result.output[-4000:]
    assert "from the node-local tier" not in result.output
    skipped = [line for line in result.output.splitlines() if "skipping the node-local copies in" in line]
    assert len(skipped) == 1 and str(shm / "default") in skipped[0], result.output[-4000:]
    assert result.summary["params_sha256"] == reference_run.result.summary["params_sha256"]
    assert result.summary["attempts"] == "1"
    assert fast_copies(shm) == left_by_a, "another run's copies are skipped, never deleted"

    # Run A again, with its own durable store: its copy is its own, and is restored.
    again = launch_job(tmp_path, "a-again", [f"run.dir={tmp_path / 'run-a'}", *fast])
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    resumed = parse_job(again.output())
    assert f"restored step {KILL_STEP} from the node-local tier of node 0 (rank 0) (a survivor copy)" in resumed.output, \
        resumed.output[-4000:]
    assert start_steps(resumed.output) == [KILL_STEP]
    assert resumed.summary["params_sha256"] == reference_run.result.summary["params_sha256"]
    for rank in (0, 1):  # A's attempt up to the copy, then A again: the unbroken run's samples in its order
        assert stitch(read_traces(tmp_path / "trace", rank), [0, KILL_STEP]) == reference_run.traces[rank]
    assert fast_copies(shm) == [], "DONE gives the node's memory back"
