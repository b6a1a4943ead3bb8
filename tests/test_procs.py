"""The process helpers on real processes: real fork, real SIGKILL, real torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import procs

TORCHRUN_TIMEOUT_S = 120.0
# torchrun's own warning about setting OMP_NUM_THREADS is noise in every log.
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1"}


def write_script(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def torchrun_args(script: Path, *, max_restarts: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.1",
        str(script),
    ]


@pytest.mark.slow
def test_pid_alive_is_false_for_a_zombie_and_a_missing_pid():
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert procs.pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        # Not reaped yet (no wait/poll), so the kernel keeps it as a zombie.
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, f"pid {child.pid} never became a zombie"
            time.sleep(0.01)
        assert not procs.pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert not procs.pid_alive(pid_max)  # pids are always below pid_max


@pytest.mark.slow
def test_kill_all_kills_a_child_orphaned_in_its_own_session(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent_script = write_script(
        tmp_path / "parent.py",
        f"""
        import subprocess, time
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
        """,
    )
    launched = procs.launch([sys.executable, str(parent_script)], log_path=tmp_path / "parent.log")
    child_pid = int(procs.wait_for_file(pid_file, timeout_s=30, launched=launched))

    assert child_pid in launched.refresh()
    assert procs.descendants(launched.proc.pid) == [child_pid]

    os.kill(launched.proc.pid, signal.SIGKILL)
    launched.proc.wait()
    assert procs.pid_alive(child_pid), "the child in its own session should outlive its parent"
    assert procs.parent_pid(child_pid) != launched.proc.pid
    assert launched.leftover_pids() == [child_pid]

    launched.kill_all()
    assert not procs.pid_alive(child_pid)
    assert launched.leftover_pids() == []


@pytest.mark.slow
def test_refresh_finds_children_that_an_orphan_starts_after_its_parent_died(tmp_path):
    go_file = tmp_path / "go"
    orphan_pid_file = tmp_path / "orphan.pid"
    grandchild_pid_file = tmp_path / "grandchild.pid"
    orphan_script = write_script(
        tmp_path / "orphan.py",
        f"""
        import os, subprocess, time
        open({str(orphan_pid_file)!r}, "w").write(str(os.getpid()))
        while not os.path.exists({str(go_file)!r}):
            time.sleep(0.02)
        grandchild = subprocess.Popen(["sleep", "60"])
        open({str(grandchild_pid_file)!r}, "w").write(str(grandchild.pid))
        time.sleep(60)
        """,
    )
    parent_script = write_script(
        tmp_path / "parent.py",
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, {str(orphan_script)!r}], start_new_session=True)
        time.sleep(60)
        """,
    )
    launched = procs.launch([sys.executable, str(parent_script)], log_path=tmp_path / "parent.log")
    orphan_pid = int(procs.wait_for_file(orphan_pid_file, timeout_s=30, launched=launched))
    assert orphan_pid in launched.refresh()

    os.kill(launched.proc.pid, signal.SIGKILL)
    launched.proc.wait()
    go_file.touch()
    grandchild_pid = int(procs.wait_for_file(grandchild_pid_file, timeout_s=30))

    # The grandchild is no descendant of the dead agent, only of the orphan seen before.
    assert procs.descendants(launched.proc.pid) == []
    assert launched.refresh() == {orphan_pid, grandchild_pid}

    launched.kill_all()
    assert not procs.pid_alive(orphan_pid)
    assert not procs.pid_alive(grandchild_pid)
    assert launched.leftover_pids() == []


@pytest.mark.slow
def test_wait_for_names_what_it_waited_for_and_kills_the_tree(tmp_path):
    launched = procs.launch(
        [sys.executable, "-c", "import time; print('started and sleeping', flush=True); time.sleep(60)"],
        log_path=tmp_path / "sleeper.log",
    )
    launched.wait_for(lambda text: "started" in text, timeout_s=30, what="the start line")

    with pytest.raises(AssertionError) as failure:
        launched.wait_for(lambda text: "never printed" in text, timeout_s=0.5, what="a line that never comes")

    assert "a line that never comes" in str(failure.value)
    assert "started and sleeping" in str(failure.value)
    assert launched.proc.returncode == -signal.SIGKILL
    assert launched.leftover_pids() == []


@pytest.mark.slow
def test_wait_for_fails_at_once_when_the_agent_exits_first(tmp_path):
    launched = procs.launch(
        [sys.executable, "-c", "print('giving up', flush=True); raise SystemExit(3)"],
        log_path=tmp_path / "quitter.log",
    )
    started_s = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        launched.wait_for(lambda text: "never printed" in text, timeout_s=60, what="a line that never comes")

    assert time.monotonic() - started_s < 30
    assert "exited with code 3" in str(failure.value)
    assert "giving up" in str(failure.value)


@pytest.mark.slow
def test_wait_times_out_with_the_output_tail(tmp_path):
    launched = procs.launch(
        [sys.executable, "-c", "import time; print('still busy', flush=True); time.sleep(60)"],
        log_path=tmp_path / "busy.log",
    )
    launched.wait_for(lambda text: "still busy" in text, timeout_s=30, what="the busy line")
    with pytest.raises(AssertionError, match="still busy"):
        launched.wait(timeout_s=0.3)
    assert launched.leftover_pids() == []


@pytest.mark.slow
def test_reap_fixture_kills_what_a_test_left_running(tmp_path):
    pid_file = tmp_path / "child.pid"
    launched = procs.launch(
        [
            sys.executable,
            "-c",
            "import subprocess, time; "
            "child = subprocess.Popen(['sleep', '60'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)",
        ],
        log_path=tmp_path / "left.log",
    )
    child_pid = int(procs.wait_for_file(pid_file, timeout_s=30, launched=launched))
    launched.refresh()

    fixture = procs.reap_fixture()
    next(fixture)  # the "test" runs here
    with pytest.raises(StopIteration):
        next(fixture)

    assert launched.proc.returncode == -signal.SIGKILL
    assert not procs.pid_alive(child_pid)


@pytest.mark.torchrun
def test_torchrun_restarts_both_ranks_after_a_worker_sigkill(tmp_path):
    pid_file = tmp_path / "rank1.pid"
    worker = write_script(
        tmp_path / "worker.py",
        f"""
        import os, time
        rank = int(os.environ["RANK"])
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"worker rank={{rank}} pid={{os.getpid()}} restart={{restart}}", flush=True)
        if restart == 0 and rank == 1:
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        """,
    )
    started_s = time.monotonic()
    launched = procs.launch(
        torchrun_args(worker, max_restarts=1), log_path=tmp_path / "torchrun.log", env=TORCHRUN_ENV
    )
    killed_pid = int(procs.wait_for_file(pid_file, timeout_s=TORCHRUN_TIMEOUT_S, launched=launched))
    assert killed_pid in launched.refresh()

    os.kill(killed_pid, signal.SIGKILL)
    exit_code = launched.wait(timeout_s=TORCHRUN_TIMEOUT_S)
    output = launched.output()
    print(f"torchrun with one restart took {time.monotonic() - started_s:.1f} s")

    assert exit_code == 0, output
    starts = {
        (int(rank), int(restart)): int(pid)
        for rank, pid, restart in re.findall(r"worker rank=(\d+) pid=(\d+) restart=(\d+)", output)
    }
    assert sorted(starts) == [(0, 0), (0, 1), (1, 0), (1, 1)], output
    assert starts[(1, 0)] == killed_pid
    assert starts[(1, 1)] != killed_pid
    # Workers that exit within one polling interval may never be seen; none may be left.
    assert launched.leftover_pids() == []
    assert not any(procs.pid_alive(pid) for pid in starts.values())


@pytest.mark.torchrun
def test_kill_all_kills_workers_orphaned_by_an_agent_sigkill(tmp_path):
    worker = write_script(
        tmp_path / "worker.py",
        f"""
        import os, time
        rank = os.environ["RANK"]
        open(os.path.join({str(tmp_path)!r}, f"rank{{rank}}.pid"), "w").write(str(os.getpid()))
        for tick in range(600):
            print(f"worker rank={{rank}} tick={{tick}}", flush=True)
            time.sleep(0.1)
        """,
    )
    launched = procs.launch(
        torchrun_args(worker, max_restarts=0), log_path=tmp_path / "torchrun.log", env=TORCHRUN_ENV
    )
    worker_pids = {
        int(procs.wait_for_file(tmp_path / f"rank{rank}.pid", timeout_s=TORCHRUN_TIMEOUT_S, launched=launched))
        for rank in (0, 1)
    }
    assert worker_pids <= launched.refresh()
    agent_pid = launched.proc.pid
    assert {procs.parent_pid(pid) for pid in worker_pids} == {agent_pid}

    os.kill(agent_pid, signal.SIGKILL)
    assert launched.proc.wait(timeout=10) == -signal.SIGKILL
    ticks_at_kill = launched.output().count("tick=")

    # Watch the orphans for a while: torchrun starts each worker in its own session and
    # nothing in a plain worker notices that the agent is gone.
    observe_s = 2.0
    time.sleep(observe_s)
    survivors = sorted(pid for pid in worker_pids if procs.pid_alive(pid))
    new_parents = {pid: procs.parent_pid(pid) for pid in survivors}
    ticks_after = launched.output().count("tick=")
    print(
        f"{observe_s:.0f} s after SIGKILL of agent {agent_pid}: workers {sorted(worker_pids)}, alive {survivors}, "
        f"now children of {new_parents}, {ticks_after - ticks_at_kill} more tick lines logged"
    )
    assert survivors == sorted(worker_pids), "workers died with the agent: this test no longer covers orphans"
    assert ticks_after > ticks_at_kill, "orphaned workers alive but no longer writing to the log"

    launched.kill_all()
    assert not any(procs.pid_alive(pid) for pid in worker_pids), "a worker survived kill_all()"
    assert launched.leftover_pids() == []
