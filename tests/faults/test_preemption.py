"""Preemption under real torchrun: a real signal in, a snapshot out, zero lost steps.

Each test pauses a worker inside a known step (the test task waits in its loss function), sends
a real signal to a real pid, lets the step finish, and checks: every rank stopped at the same
step, rank 0 committed a snapshot of exactly that step, the workers exited with 143, and the
next launch of the same command resumed there and ended bitwise equal to the unbroken run
having trained every sample exactly once (the stitched per-rank traces equal the reference's).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.dist.vote import MAX_STEPS_BETWEEN_VOTES
from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.jobs import ONE_THREAD, TIMEOUT_S, launch_job, start_steps
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun

PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


def pause_then(workdir: Path, job: procs.Launched, rank: int, send) -> int:
    """Wait until ``rank`` pauses inside its step, call ``send(worker_pid)``, then let the step go on."""
    marker = workdir / "trace" / f"paused-rank{rank}.pid"
    pid = int(procs.wait_for_file(marker, TIMEOUT_S, job))
    send(pid)
    marker.with_suffix(".resume").touch()
    return pid


def assert_zero_lost_steps_and_bitwise(workdir: Path, reference, output: str, preempted_step: int) -> None:
    result = parse_job(output)
    assert result.summary["params_sha256"] == reference.result.summary["params_sha256"]
    for rank in (0, 1):
        attempts = read_traces(workdir / "trace", rank)
        # Zero lost steps: the preempted attempt trained exactly up to the step it saved.
        assert len(attempts[0]) == preempted_step, f"rank {rank} trained steps the snapshot does not hold"
        assert stitch(attempts, [0, preempted_step]) == reference.traces[rank]


def preempted_step(output: str, signalled_in: int) -> int:
    """The one step the job stopped at: after the signal's step, within two votes of it."""
    found = [int(s) for s in PREEMPTED.findall(output)]
    assert len(found) == 1, output[-3000:]
    # The signal is posted at the first voting boundary after its step and read at the next one;
    # the pause inside the signalled step makes rank 0 propose a vote at every step after it.
    assert signalled_in < found[0] <= signalled_in + 2 * MAX_STEPS_BETWEEN_VOTES, found
    return found[0]


def test_sigterm_to_the_torchrun_agent_snapshots_the_current_step_and_the_relaunch_loses_nothing(tmp_path, reference_run):
    same_command = ["task.args.pause_rank=0", "task.args.pause_at_step=37"]  # the pause happens once per job
    job = launch_job(tmp_path, "first", same_command)
    sent = []
    pause_then(tmp_path, job, 0, lambda pid: (sent.append(time.monotonic()), os.kill(job.proc.pid, signal.SIGTERM)))
    job.wait(TIMEOUT_S)
    exited_s = time.monotonic() - sent[0]
    output = job.output()
    # The signal reached rank 0 inside step 37; every rank stops at one later step and rank 0
    # commits exactly that step.
    stopped = preempted_step(output, 37)
    assert "rank 0 received SIGTERM at step 37" in output
    assert f"state SNAPSHOT -> PREEMPTED at step {stopped}" in output
    assert SnapshotStore(str(tmp_path / "run" / "snapshots")).latest_valid()[0].step == stopped
    assert "Traceback" not in "\n".join(line for line in output.splitlines() if "[elastictrain r" in line)
    print(f"SIGTERM to agent -> agent exited: {exited_s:.2f} s")

    again = launch_job(tmp_path, "second", same_command)
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    assert start_steps(again.output()) == [stopped]
    summary = parse_job(again.output()).summary
    assert summary["attempts"] == "2", "the relaunch is the run's second attempt"
    assert_zero_lost_steps_and_bitwise(tmp_path, reference_run, again.output(), stopped)


def test_sigkill_to_the_torchrun_agent_stops_its_orphaned_workers_with_a_snapshot_and_the_relaunch_loses_nothing(
        tmp_path, reference_run):
    """The workers torchrun started directly (no warm start) ask the kernel for a SIGTERM when the agent exits."""
    same_command = ["task.args.pause_rank=0", "task.args.pause_at_step=37"]
    job = launch_job(tmp_path, "first", same_command, warmstart=False)

    def kill_agent(worker_pid: int) -> None:
        job.refresh()  # the workers' pids: orphans once the agent is gone
        os.kill(job.proc.pid, signal.SIGKILL)
        # Reaped: every agent thread has ended, so the kernel has signalled rank 0, whose handler runs in its pause,
        # before it reads the file that lets step 37 go on.
        assert job.proc.wait(TIMEOUT_S) == -signal.SIGKILL

    pause_then(tmp_path, job, 0, kill_agent)
    assert procs.still_running(job.leftover_pids, TIMEOUT_S) == [], "an orphaned worker trained on"
    output = job.output()
    stopped = preempted_step(output, 37)
    assert "rank 0's torchrun agent exited, its signal SIGTERM at step 37:" in output, output[-3000:]
    assert SnapshotStore(str(tmp_path / "run" / "snapshots")).latest_valid()[0].step == stopped

    again = launch_job(tmp_path, "second", same_command)
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    assert start_steps(again.output()) == [stopped]
    assert_zero_lost_steps_and_bitwise(tmp_path, reference_run, again.output(), stopped)


def test_sigterm_to_one_worker_stops_every_rank_and_torchrun_restarts_with_nothing_lost(tmp_path, reference_run):
    # Snapshots written in the background: the preemption snapshot is waited for before exit 143.
    job = launch_job(tmp_path, "job", ["task.args.pause_rank=1", "task.args.pause_at_step=61", "snapshot.durable.async_write=true"])
    pause_then(tmp_path, job, 1, lambda pid: os.kill(pid, signal.SIGTERM))
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    stopped = preempted_step(output, 61)
    assert "rank 1 received SIGTERM at step 61" in output  # inside step 61, noticed at its end
    # The workers left with 143; torchrun counted one failed attempt and restarted from step 62.
    assert "failed (exitcode: 143)" in output
    assert start_steps(output) == [0, stopped]
    assert parse_job(output).summary["restart"] == "1"
    assert_zero_lost_steps_and_bitwise(tmp_path, reference_run, output, stopped)


def test_a_second_signal_during_the_snapshot_write_does_not_tear_it(tmp_path, reference_run):
    """SIGTERM, then SIGTERM and SIGINT again while rank 0 is inside the preemption snapshot's write."""
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    # A vote at every step, so the preemption snapshot is of step 21 and its write meets the failpoint.
    job = launch_job(tmp_path, "first", ["task.args.pause_rank=0", "task.args.pause_at_step=20", "preempt.vote_every_s=0"],
                     env={"ELASTICTRAIN_FAILPOINT": f"snapshot-write@21:{failpoints}"})
    pause_then(tmp_path, job, 0, lambda pid: os.kill(pid, signal.SIGTERM))
    writer_pid = int(procs.wait_for_file(failpoints / "failpoint-snapshot-write.pid", TIMEOUT_S, job))
    os.kill(writer_pid, signal.SIGTERM)
    os.kill(writer_pid, signal.SIGINT)
    (failpoints / "failpoint-snapshot-write.resume").touch()
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    assert [int(s) for s in PREEMPTED.findall(output)] == [21], output[-3000:]
    assert "2 more signal(s) arrived while stopping; the snapshot was not interrupted" in output
    # The snapshot of step 21 was committed whole: torchrun's restart restored it and lost nothing.
    assert start_steps(output) == [0, 21]
    assert "skipping snapshot" not in output
    assert_zero_lost_steps_and_bitwise(tmp_path, reference_run, output, 21)


def test_ctrl_c_in_a_plain_python_run_stops_cleanly_and_resumes(tmp_path):
    """One process, no launcher: SIGINT is a preemption, not a page of KeyboardInterrupt tracebacks."""
    # The unbroken run and the interrupted one are single processes in directories of their own:
    # they run side by side, one per core (one intra-op thread each, as torchrun gives its workers, in all three runs).
    unbroken = launch_job(tmp_path / "unbroken", "job", single_process=True, env=ONE_THREAD) if (tmp_path / "unbroken").mkdir() is None else None
    same_command = ["task.args.pause_rank=0", "task.args.pause_at_step=50"]
    job = launch_job(tmp_path, "first", same_command, single_process=True, env=ONE_THREAD)
    pause_then(tmp_path, job, 0, lambda pid: os.kill(pid, signal.SIGINT))
    assert unbroken.wait(TIMEOUT_S) == 0, unbroken.output()[-4000:]
    assert job.wait(TIMEOUT_S) == 143
    output = job.output()
    # Without a vote partner the request is seen at the boundary of the step it arrived in.
    assert [int(s) for s in PREEMPTED.findall(output)] == [50]
    assert "KeyboardInterrupt" not in output and "Traceback" not in output

    again = launch_job(tmp_path, "second", same_command, single_process=True, env=ONE_THREAD)
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    assert parse_job(again.output()).summary["params_sha256"] == parse_job(unbroken.output()).summary["params_sha256"]
    first, second = read_traces(tmp_path / "trace", 0)
    assert len(first) == 50
    assert stitch([first, second], [0, 50]) == read_traces(tmp_path / "unbroken" / "trace", 0)[0]
