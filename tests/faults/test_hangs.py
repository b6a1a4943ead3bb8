"""Hung and slow ranks under real torchrun: a frozen or stuck worker becomes a restart in seconds.

A worker that stops making progress (SIGSTOP, a loss function that never returns) is named by
every live rank's watchdog in one line, the stuck workers leave with the watchdog's exit code
and a stack dump, torchrun restarts the group from the newest snapshot, and the run ends
bitwise equal to the unbroken reference. A run made slow on purpose raises no alarm, and a rank
made slow on purpose is named as a straggler.

The jobs run the real ``-m elastictrain train`` test job with the watchdog's timeout cut to a
few seconds.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from elastictrain.health.watchdog import HUNG_EXIT_CODE
from tests.conftest import job_env, parse_job, python_command, torchrun_launcher
from tests.helpers import procs
from tests.helpers.jobs import JOB, TIMEOUT_S, start_steps
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun

FAST_WATCHDOG = {"hang_timeout_s": 2, "heartbeat_every_s": 0.5}  # as the single-process test below
HANG = re.compile(r"\[elastictrain r(\d) a0\] ERROR rank \d: no progress for [\d.]+ s in state (\w+) at step (\d+)[^;]*; (.*); exiting with code 75")


def launch_watched(workdir: Path, extra: list[str] = (), *, watchdog: dict = FAST_WATCHDOG, stragglers: dict | None = None,
                   single_process: bool = False, env: dict[str, str] | None = None) -> procs.Launched:
    (workdir / "trace").mkdir(exist_ok=True)
    settings = [f"watchdog.{key}={value}" for key, value in watchdog.items()]
    settings += [f"stragglers.{key}={value}" for key, value in (stragglers or {}).items()]
    overrides = [*JOB, f"task.args.trace_dir={workdir / 'trace'}", f"run.dir={workdir / 'run'}", *settings, *extra]
    command = python_command(overrides) if single_process else [*torchrun_launcher(), "-m", "elastictrain", "train", *overrides]
    return procs.launch(command, log_path=workdir / "job.log", env={**job_env(), **(env or {})}, cwd=workdir)


def assert_bitwise(workdir: Path, reference, output: str) -> None:
    assert parse_job(output).summary["params_sha256"] == reference.result.summary["params_sha256"]
    for rank in (0, 1):
        assert stitch(read_traces(workdir / "trace", rank), start_steps(output)) == reference.traces[rank]


def test_a_sigstopped_worker_is_found_silent_by_its_peer_long_before_the_allowance_and_the_group_restarts(tmp_path,
                                                                                                         reference_run):
    # A frozen rank is not slow: its silent heartbeat ends the wait, not the 600 s allowance kept
    # for ranks alive but not progressing. A stopped process does not act on torchrun's SIGTERM,
    # and torch 2.13's agent waits 30 s before its SIGKILL on a restart: the peer's watchdog
    # SIGKILLs the stopped worker itself.
    job = launch_watched(tmp_path, ["task.args.pause_rank=1", "task.args.pause_at_step=37"],
                         watchdog={"hang_timeout_s": 600, "heartbeat_every_s": 1})
    pid = int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job))
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    job.wait_for(lambda out: "a1] INFO restored snapshot" in out, 30, "the restarted group's restore")
    restart_s = time.monotonic() - stopped_at
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    print(f"SIGSTOP of rank 1 -> restarted group restored its snapshot: {restart_s:.1f} s")

    # The live rank names the frozen one and its state, in one line; the frozen one said nothing.
    hangs = HANG.findall(output)
    assert [(r, state, step) for r, state, step, _ in hangs] == [("0", "TRAIN", "36")], output[-4000:]
    # Named by its stopped process (/proc) at the second poll, not after its heartbeat's 3 s of staleness.
    assert re.search(r"a0\] ERROR rank 0: no progress for [\d.]+ s in state TRAIN at step 36 and rank 1's heartbeat has "
                     r"not changed for [\d.]+ s and its process is stopped on this host; ", output), output[-4000:]
    assert re.match(r"rank 1 sent no heartbeat for [\d.]+ s \(last in state TRAIN at step \d+\): frozen, killed or its host "
                    rf"is gone \(rank 1 is stopped process {pid} on this host: SIGKILL", hangs[0][3]), hangs[0][3]
    assert start_steps(output) == [0, 25]
    assert_bitwise(tmp_path, reference_run, output)


def test_a_rank_slow_past_the_heartbeat_staleness_under_load_is_not_taken_for_a_frozen_one(tmp_path, reference_run):
    # What names a frozen peer is its heartbeat's silence, not its progress. Rank 1 stops stepping for 5 s (its
    # process runs: a long step) with two CPU-bound processes beside the job; rank 0's step is overdue from the
    # first second, so it reads rank 1's heartbeats every 0.25 s past their 3 s of staleness: they keep changing.
    with procs.cpu_burners(2):
        job = launch_watched(tmp_path, ["task.args.pause_rank=1", "task.args.pause_at_step=37"],
                             watchdog={"hang_timeout_s": 600, "heartbeat_every_s": 1})
        procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)
        time.sleep(5)
        (tmp_path / "trace" / "paused-rank1.resume").write_text("")
        assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    assert "no progress" not in output and start_steps(output) == [0], output[-4000:]
    assert_bitwise(tmp_path, reference_run, output)


def test_a_loss_function_that_never_returns_is_named_by_both_ranks_with_a_stack_dump(tmp_path, reference_run):
    job = launch_watched(tmp_path, ["task.args.sleep_rank=1", "task.args.sleep_at_step=30"])
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    hangs = {rank: (state, step, stopped) for rank, state, step, stopped in HANG.findall(output)}
    assert sorted(hangs) == ["0", "1"], output[-4000:]  # each live rank, one line each
    for rank, (state, step, stopped) in hangs.items():
        assert (state, step) == ("TRAIN", "29")
        assert re.match(r"rank 1 is stuck in state TRAIN at step 29 at tests\.helpers\.tasks:\d+ in traced_loss while the "
                        "others wait for it in a collective", stopped), stopped
    # The stuck worker's stack, dumped before it left, shows where it was. Both ranks dump at the same
    # moment into the agent's one stream, which can interleave their writes: the file and the
    # function are each one write of faulthandler's, so look for them, not for a whole line.
    dump = output.split("rank 1: no progress")[1]
    assert "tests/helpers/tasks.py" in dump and "traced_loss" in dump.split("most recent call first", 1)[1]
    assert f"exitcode: {HUNG_EXIT_CODE}" in output
    assert start_steps(output) == [0, 25]
    assert_bitwise(tmp_path, reference_run, output)


def test_a_single_process_whose_loss_function_never_returns_leaves_with_a_stack_dump(tmp_path):
    job = launch_watched(tmp_path, ["task.args.sleep_rank=0", "task.args.sleep_at_step=20"],
                         watchdog={"hang_timeout_s": 2, "heartbeat_every_s": 0.5}, single_process=True)
    assert job.wait(TIMEOUT_S) == HUNG_EXIT_CODE
    output = job.output()
    assert re.search(r"ERROR rank 0: no progress for [\d.]+ s in state TRAIN at step 19 \(allowed [\d.]+ s\); rank 0 \(alone\) "
                     r"is stuck at tests\.helpers\.tasks:\d+ in traced_loss; exiting with code 75", output), output[-3000:]
    assert re.search(r'File ".*tests/helpers/tasks.py", line \d+ in traced_loss', output)


def test_steps_slower_than_the_timeout_raise_no_alarm(tmp_path):
    """Each step takes 1.2 s, over the 0.8 s timeout: the allowance follows the measured step time."""
    job = launch_watched(tmp_path, ["train.max_steps=3", "task.args.step_sleep_s=1.2"],
                         watchdog={"hang_timeout_s": 0.8, "heartbeat_every_s": 0.2, "first_step_s": 30})
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    assert parse_job(output).summary["step"] == "3"
    assert "no progress" not in output and start_steps(output) == [0]


def test_a_rank_made_slow_on_purpose_is_named_as_a_straggler_and_the_bits_do_not_change(tmp_path, reference_run):
    job = launch_watched(tmp_path, ["task.args.slow_rank=1", "task.args.slow_step_s=0.02"], stragglers={"repeat_after_s": 3600})
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    warnings = re.findall(r"r0 a0\] WARNING straggler at step (\d+): (.*)", output)
    # Named once (rate-limited), by compute: both ranks' step times are equal under DDP.
    assert len(warnings) == 1, output[-4000:]
    assert re.match(r"rank 1: [\d.]+ ms per step, [\d.]+x the others' median [\d.]+ ms; every rank waits for it in "
                    r"each step \(compute = step time minus the wait in the gradient all-reduce", warnings[0][1]), warnings[0][1]
    # The timing hook does DDP's own arithmetic: the run ends bitwise equal to the unbroken one.
    assert_bitwise(tmp_path, reference_run, output)
