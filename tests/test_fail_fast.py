"""When no restart can help, a job under plain torchrun fails fast and says why once.

Real torchrun, real gloo, real SIGTERMs from the agent: a rank 0 that dies before the process
group forms leaves its peer waiting in set-up, and the agent's SIGTERM must end that peer at once
(torchrun SIGKILLs it only after its 30 s ``--shutdown-timeout``) with one line naming what it
waited for. An error no restart can fix is said once on the node, and the later attempts torchrun
makes anyway stop before they import torch.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, job_env, torchrun_launcher
from tests.helpers import procs

TIMEOUT_S = 240  # generous: the machine is shared; before the fix one attempt alone took 30 s + start-up

RANK0_DIES_FIRST = textwrap.dedent('''
    import os, sys, time
    from elastictrain import Trainer, seed_everything
    from tests.helpers.tasks import build

    seed_everything(0)
    os.makedirs(sys.argv[1], exist_ok=True)
    task = build(sys.argv[1], train_samples=256, hidden=16)
    if os.environ["RANK"] == "0":
        # Die only once rank 1 waits in set-up: its request of this attempt in the round handshake (rounds.py), a
        # token other than the one the attempt before saw (kept in a file), is in the agent's store.
        import torch.distributed as dist
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        store = dist.PrefixStore(f"elastictrain/{os.environ['TORCHELASTIC_RUN_ID']}/", agent_store)
        seen = os.path.join(sys.argv[1], "rank1-token")
        before = open(seen).read() if os.path.exists(seen) else None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            token = store.get("round/req/1").decode() if store.check(["round/req/1"]) else None
            if token is not None and token != before:
                open(seen, "w").write(token)
                break
            time.sleep(0.01)
        raise RuntimeError("rank 0's own set-up failed before fit()")
    Trainer.from_task(task, config={"run": {"dir": sys.argv[1]}, "log": {"plots": False}}).fit()
''')


@pytest.mark.slow
def test_a_rank_whose_peer_died_before_the_group_formed_ends_on_sigterm_and_says_what_it_waited_for(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RANK0_DIES_FIRST)
    job = procs.launch([*torchrun_launcher(max_restarts=1), str(script), str(tmp_path / "run")],
                       log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    assert job.wait(TIMEOUT_S) != 0
    output = job.output()
    waited = re.findall(r"\[elastictrain r1 a(\d)\] ERROR (.*)", output)
    assert waited == [(str(attempt), "rank 1 was waiting for the process group (rank 0 never joined) when SIGTERM "
                                     "arrived; nothing to save") for attempt in (0, 1)], output[-4000:]
    # The agent's SIGTERM was enough: it never had to SIGKILL rank 1 after its shutdown timeout.
    assert "forcefully exiting via 9" not in output, output[-4000:]
    assert "waitForInput" not in output  # the wait polls: torch warns of every store wait that times out
    assert output.count("RuntimeError: rank 0's own set-up failed before fit()") == 2  # rank 0's bug keeps its traceback
    assert "Traceback" in output


def worker_stderr(log_dir: Path) -> dict[tuple[int, int], str]:
    """Each worker's stderr, by (attempt, local rank), from torchrun's ``--log-dir`` with ``--redirects=3``."""
    files = log_dir.glob("*/attempt_*/*/stderr.log")
    return {(int(f.parent.parent.name.removeprefix("attempt_")), int(f.parent.name)): f.read_text() for f in files}


def said(text: str) -> list[str]:
    """A worker's stderr without the lines of ``python -X importtime``."""
    return [line for line in text.splitlines() if not line.startswith("import time:")]


TORCH_IMPORTED = re.compile(r"^import time:.*\|\s+torch$", re.MULTILINE)  # python -X importtime: the package itself


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("train.bach_size=3", "invalid config (defaults + overrides): unknown key 'train.bach_size' (did you mean "
                          "'train.batch_size'?)"),
    ("dist.backend=nccl", "dist.backend=nccl needs a CUDA device; use dist.backend=gloo on CPU"),
], ids=["config-typo", "nccl-on-cpu"])
def test_an_error_no_restart_can_fix_is_said_by_one_rank_once_and_later_attempts_do_not_import_torch(
        tmp_path, override, message):
    log_dir = tmp_path / "torchrun-logs"
    launcher = [*torchrun_launcher(max_restarts=2), f"--log-dir={log_dir}", "--redirects=3"]
    job = procs.launch([*launcher, "-m", "elastictrain", "train", override, f"run.dir={tmp_path / 'run'}",
                        "log.plots=false"],
                       log_path=tmp_path / "job.log", env={**job_env(), "PYTHONPROFILEIMPORTTIME": "1"}, cwd=tmp_path)
    assert job.wait(TIMEOUT_S) != 0
    stderr = worker_stderr(log_dir)
    assert {attempt for attempt, _ in stderr} == {0, 1, 2}, sorted(stderr)  # torchrun restarted twice regardless
    saying = {worker: [line for line in text.splitlines() if message in line] for worker, text in stderr.items()}
    saying = {worker: lines for worker, lines in saying.items() if lines}
    # One rank of the first attempt says it, not every rank of every attempt.
    first = {worker: lines for worker, lines in saying.items() if worker[0] == 0}
    assert len(first) == 1, saying
    ((_, rank), lines), = first.items()
    if override.startswith("dist."):  # met in fit(): the rank's log line says it and where; the command line is silent
        assert len(lines) == 1 and lines[0].endswith(f"ERROR rank {rank} stopped in state SETUP at step 0: {message}"), lines
    else:
        assert lines == [f"elastictrain: error: {message}"], lines
    # Each later attempt: the node's local rank 0 says it again, in one line, and stops before importing torch.
    later_lines = {worker: lines for worker, lines in saying.items() if worker[0] > 0}
    assert later_lines == {(attempt, 0): [f"elastictrain: error: {message} (rank {rank} met it in attempt 0; restart "
                                          f"{attempt} stopped at once: no restart can fix it)"] for attempt in (1, 2)}, \
        later_lines
    assert not any("skipped" in text for text in stderr.values())
    later = {worker: text for worker, text in stderr.items() if worker[0] > 0}
    assert not any(TORCH_IMPORTED.search(text) for text in later.values()), \
        [worker for worker, text in later.items() if TORCH_IMPORTED.search(text)]
    if override.startswith("dist."):  # the check can see an import: attempt 0 imported torch
        assert any(TORCH_IMPORTED.search(text) for worker, text in stderr.items() if worker[0] == 0)


def torchrun_env(run_dir: Path, restart: int, rank: int) -> dict[str, str]:
    """What torchrun tells a worker about where its error file goes, as its own layout has it."""
    return {"TORCHELASTIC_ERROR_FILE": str(run_dir / f"attempt_{restart}" / str(rank) / "error.json"),
            "TORCHELASTIC_RESTART_COUNT": str(restart), "RANK": str(rank)}


def test_the_first_rank_to_meet_a_fatal_error_says_it_and_later_attempts_find_it(tmp_path):
    from elastictrain.core.errors import ConfigError, PeerLost
    from elastictrain.core.fatal import FatalRecord, claim_line, earlier_attempt_failed, marker_path

    run_dir = tmp_path / "none_abc123"  # torchrun's directory for this agent's run
    run_dir.mkdir()
    first, second = ConfigError("unknown key 'train.bach_size'"), ConfigError("unknown key 'train.bach_size'")
    assert earlier_attempt_failed(torchrun_env(run_dir, 0, 0)) is None
    assert claim_line(first, torchrun_env(run_dir, 0, 1))
    assert claim_line(first, torchrun_env(run_dir, 0, 1)), "the rank that logged it also prints it"
    assert not claim_line(second, torchrun_env(run_dir, 0, 0)), "its peer of the same attempt stays silent"
    assert claim_line(PeerLost("rank 0 lost a peer"), torchrun_env(run_dir, 0, 0)), "retryable: every rank says its own"
    assert earlier_attempt_failed(torchrun_env(run_dir, 0, 0)) is None, "this very attempt: it meets the error itself"
    assert earlier_attempt_failed(torchrun_env(run_dir, 2, 0)) == FatalRecord(
        restart=0, rank=1, kind="ConfigError", exit_code=2, message="unknown key 'train.bach_size'")
    assert marker_path(torchrun_env(run_dir, 0, 0)) == run_dir / "elastictrain-fatal-error.json"


@pytest.mark.parametrize("layout", ["no torchrun", "another layout"])
def test_without_torchrun_s_layout_every_process_says_its_error(tmp_path, layout):
    from elastictrain.core.errors import ConfigError
    from elastictrain.core.fatal import claim_line, earlier_attempt_failed

    (tmp_path / "logs" / "run" / "0").mkdir(parents=True)
    environ = {} if layout == "no torchrun" else {
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "logs" / "run" / "0" / "error.json"), "TORCHELASTIC_RESTART_COUNT": "1"}
    for rank in (0, 1):  # two processes, each with its own exception
        assert claim_line(ConfigError("unknown key"), {**environ, "RANK": str(rank)})
    assert earlier_attempt_failed({**environ, "TORCHELASTIC_RESTART_COUNT": "2"} if environ else {}) is None
    assert not list(tmp_path.rglob("elastictrain-fatal-error.json"))


def test_a_later_attempt_stops_on_import_with_the_line_said_by_local_rank_0_only(tmp_path, capsys):
    from elastictrain.core.errors import UsageError
    from elastictrain.core.fatal import claim_line, stop_if_an_earlier_attempt_failed

    run_dir = tmp_path / "none_abc123"
    run_dir.mkdir()
    stop_if_an_earlier_attempt_failed({**torchrun_env(run_dir, 0, 0), "LOCAL_RANK": "0"})  # nothing recorded: goes on
    assert claim_line(UsageError("session.step() twice"), torchrun_env(run_dir, 0, 1))
    for local_rank, says in (("0", True), ("1", False)):
        with pytest.raises(SystemExit) as stopped:
            stop_if_an_earlier_attempt_failed({**torchrun_env(run_dir, 1, int(local_rank)), "LOCAL_RANK": local_rank})
        assert stopped.value.code == 2
        said = capsys.readouterr().err.splitlines()
        assert said == (["elastictrain: error: session.step() twice (rank 1 met it in attempt 0; restart 1 stopped at "
                         "once: no restart can fix it)"] if says else []), said
    # The other local ranks wait for this mark before they exit: torchrun would end local rank 0 with them.
    assert (run_dir / "said-1").exists()
    stop_if_an_earlier_attempt_failed({**torchrun_env(run_dir, 0, 0), "LOCAL_RANK": "0"})  # its own attempt: goes on


def crash(kind="RuntimeError", message="boom", step=30, restart=0, rank=1):
    from elastictrain.core.repeats import Crash

    return Crash(kind, message, step, restart, rank)


@pytest.mark.parametrize("earlier, now, repeats", [
    ([], crash(restart=1), None),
    ([crash()], crash(restart=1), 0),  # the same exception at the same step after a restore: a bug
    ([crash()], crash(restart=1, rank=0), 0),  # on another rank (the world may have changed): the same bug
    ([crash()], crash(restart=0, rank=0), None),  # another rank of the same attempt: not a replay
    ([crash()], crash(restart=1, step=31), None),  # another step: a fault that recurs, the restart is the answer
    ([crash()], crash(restart=1, message="boom 2"), None),
    ([crash()], crash(restart=1, kind="ValueError"), None),
    ([crash(step=12), crash(restart=1, step=30)], crash(restart=2), 1),  # the attempt before it, not the one before that
], ids=["first", "repeat", "other-rank", "same-attempt", "other-step", "other-message", "other-type", "newest-match"])
def test_a_crash_repeats_when_an_earlier_attempt_crashed_the_same_way_at_the_same_step(earlier, now, repeats):
    from elastictrain.core.repeats import first_occurrence

    found = first_occurrence(earlier, now)
    assert (found.restart if found else None) == repeats


def test_crashes_are_recorded_per_attempt_in_torchrun_s_run_directory(tmp_path):
    from elastictrain.core.repeats import CRASHES_NAME, record_crash

    run_dir = tmp_path / "none_abc123"
    run_dir.mkdir()
    assert record_crash(RuntimeError("boom"), 30, torchrun_env(run_dir, 0, 1)) is None
    assert record_crash(RuntimeError("other"), 30, torchrun_env(run_dir, 1, 1)) is None  # a fault: restart
    repeated = record_crash(RuntimeError("boom"), 30, torchrun_env(run_dir, 2, 1))
    assert repeated == crash(restart=0)
    assert len((run_dir / CRASHES_NAME).read_text().splitlines()) == 3
    assert record_crash(RuntimeError("boom"), 30, {}) is None  # outside torchrun: nothing restarts, nothing recorded


MISUSED_LOOP = REPO_ROOT / "tests" / "helpers" / "misused_loop.py"


@pytest.mark.slow
def test_a_crash_that_repeats_at_the_same_step_stops_at_its_second_occurrence_and_later_attempts_cost_nothing(tmp_path):
    log_dir, run_dir = tmp_path / "torchrun-logs", tmp_path / "run"
    launcher = [*torchrun_launcher(max_restarts=3), f"--log-dir={log_dir}", "--redirects=3"]
    job = procs.launch([*launcher, str(MISUSED_LOOP), str(run_dir), "crash-in-step-31"], log_path=tmp_path / "job.log",
                       env={**job_env(), "PYTHONPROFILEIMPORTTIME": "1"}, cwd=tmp_path)
    assert job.wait(TIMEOUT_S) != 0
    stderr = worker_stderr(log_dir)
    assert {attempt for attempt, _ in stderr} == {0, 1, 2, 3}, sorted(stderr)  # plain torchrun restarts regardless
    everything = "\n".join(stderr.values())
    # The first occurrence: a bug, its traceback once (not again by Python's hook), and a restart.
    assert everything.count("Traceback (most recent call last)") == 1, everything[-4000:]
    assert stderr[0, 1].count("RuntimeError: the user's bug in step 31") == 1, stderr[0, 1][-3000:]
    # The second, after the restore of step 30: one line saying it is a bug.
    repeated = ("RuntimeError: the user's bug in step 31 again in state TRAIN at step 30, as in attempt 0 on rank 1 (its "
                "traceback is above): a restart replays the same steps, so this is a bug to fix, not a fault; no more "
                "restarts, every snapshot is kept")
    assert re.search(r"restored snapshot \S+: step 30", stderr[1, 0]), stderr[1, 0][-3000:]
    assert said(stderr[1, 1])[-1].endswith(f" ERROR rank 1: {repeated}"), said(stderr[1, 1])[-5:]
    assert stderr[1, 1].count(repeated) == 1, said(stderr[1, 1])[-5:]  # logged; Python's hook does not print it again
    # Later attempts: one line from local rank 0, no restore, no torch.
    for attempt in (2, 3):
        assert said(stderr[attempt, 0]) == [f"elastictrain: error: {repeated} (rank 1 met it in attempt 1; "
                                                       f"restart {attempt} stopped at once: no restart can fix it)"]
        assert said(stderr[attempt, 1]) == []
        assert not any(TORCH_IMPORTED.search(stderr[attempt, rank]) or "restored" in stderr[attempt, rank]
                       for rank in (0, 1)), stderr[attempt, 0][-3000:]
    assert TORCH_IMPORTED.search(stderr[0, 0])  # the check can see an import
    from elastictrain.storage.snapshot_store import SnapshotStore

    assert SnapshotStore(str(run_dir / "snapshots")).latest_valid()[0].step == 30  # every snapshot kept
