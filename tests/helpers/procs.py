"""Start process trees for tests, watch their logs, and make sure none of them outlives a test.

torchrun starts every worker in its own session, so SIGKILL on the agent leaves the workers
orphaned: they are reparented away from the agent and no longer show up as its descendants.
A ``Launched`` therefore remembers every pid it has ever seen under the agent (and under those
pids), and ``kill_all`` kills all that are still alive. Everything is read from ``/proc``;
Linux only.

A pid that died and was reaped can be reused by an unrelated process. Each seen pid is
remembered together with its start time (field 22 of ``/proc/<pid>/stat``), and a pid is only
signalled or reported while that start time still matches.
"""

from __future__ import annotations

import atexit
import glob
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

POLL_INTERVAL_S = 0.05
# While a test waits, the tree is scanned (every /proc/<pid>/stat read: a few ms of CPU) this often, not at every
# poll: at 20 scans a second the waiting test took ~6% of a core from the jobs under test, on a 2-core machine.
# Every process of a job lives far longer; kill_all() and an explicit refresh() always scan.
TRACK_INTERVAL_S = 0.5
OUTPUT_TAIL_LINES = 80
REAP_GRACE_S = 5.0
KILL_SETTLE_S = 2.0


@dataclass(frozen=True)
class _ProcStat:
    pid: int
    state: str
    ppid: int
    start_ticks: int


def _read_stat(pid: int) -> _ProcStat | None:
    """Parse /proc/<pid>/stat, or None if the process does not exist (any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            raw = stat_file.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')';
    # everything after the last ')' is space separated, starting with field 3 (state).
    fields_from_state = raw[raw.rfind(")") + 2 :].split()
    return _ProcStat(
        pid=pid,
        state=fields_from_state[0],
        ppid=int(fields_from_state[1]),
        start_ticks=int(fields_from_state[19]),
    )


def _all_stats() -> list[_ProcStat]:
    stats = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat is not None:
                stats.append(stat)
    return stats


def _is_live(stat: _ProcStat | None) -> bool:
    return stat is not None and stat.state not in ("Z", "X")


def _live_descendant_stats(root_pids: set[int], all_stats: list[_ProcStat]) -> list[_ProcStat]:
    children_by_ppid: dict[int, list[_ProcStat]] = {}
    for stat in all_stats:
        children_by_ppid.setdefault(stat.ppid, []).append(stat)
    found: dict[int, _ProcStat] = {}
    frontier = list(root_pids)
    while frontier:
        parent = frontier.pop()
        for child in children_by_ppid.get(parent, []):
            if child.pid not in found and child.pid not in root_pids:
                found[child.pid] = child
                frontier.append(child.pid)
    return [stat for stat in found.values() if _is_live(stat)]


def descendants(pid: int) -> list[int]:
    """All live descendant pids of pid (children, grandchildren...), read from /proc/<p>/stat ppid fields."""
    return sorted(stat.pid for stat in _live_descendant_stats({pid}, _all_stats()))


def parent_pid(pid: int) -> int | None:
    """The current parent pid of pid (it changes when the parent dies), or None if pid does not exist."""
    stat = _read_stat(pid)
    return None if stat is None else stat.ppid


def environ(pid: int) -> list[bytes]:
    """The ``NAME=value`` entries pid was started with (/proc/<pid>/environ: the environment at exec); [] if gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def torchrun_worker(root_pid: int, rank: int) -> int:
    """The pid torchrun started for ``rank`` under ``root_pid`` (its agent, or what started the agent).

    The process with ``RANK=<rank>`` in its environment whose parent has none: the worker when it starts
    cold, its client when it starts warm (the training process is then a child of the warm-start server,
    elsewhere; torchrun's lines name the client, which forwards every signal to it). Not a DataLoader worker.
    """
    entry = f"RANK={rank}".encode()
    for pid in descendants(root_pid):
        if entry in environ(pid) and not any(e.startswith(b"RANK=") for e in environ(parent_pid(pid) or 0)):
            return pid
    raise AssertionError(f"no worker of rank {rank} under pid {root_pid}")


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie; False for zombies and for missing pids."""
    return _is_live(_read_stat(pid))


def pids_running(script: pathlib.Path) -> list[int]:
    """Live processes other than this one whose command line names ``script`` (agents or workers of any job)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(script) in cmdline and pid_alive(int(name)):
            found.append(int(name))
    return sorted(found)


def still_running(find: Callable[[], list[int]], grace_s: float) -> list[int]:
    """Poll ``find`` until it finds no pid or ``grace_s`` has passed; the pids it found last."""
    deadline = time.monotonic() + grace_s
    while (survivors := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return survivors


def ensure_none_running(script: pathlib.Path, context: str, grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for every process running ``script`` to be gone; raise naming those that are not."""
    if survivors := still_running(lambda: pids_running(script), grace_s):
        raise RuntimeError(
            f"{context}: processes running {script.name} are still alive: {survivors}; "
            "a run would share the machine with them, so the benchmark stops here"
        )


def warm_server_pids(agent_pid: int) -> list[int]:
    """The live warm-start servers of this user and torchrun agent: each writes its pid into its lock file
    (``elastictrain.launcher.warmstart``; its server prefix names the files)."""
    from elastictrain.launcher import warmstart

    found = []
    for lock in glob.glob(glob.escape(warmstart.server_prefix(agent_pid)) + "*.lock"):
        try:
            with open(lock) as lock_file:
                pid = int(lock_file.read() or 0)
            with open(f"/proc/{pid}/stat") as stat_file:
                alive = pid > 0 and stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, ValueError):
            continue
        if alive:
            found.append(pid)
    return sorted(found)


def warm_servers(agent_pid: int) -> list[int]:
    """The live warm-start servers of a torchrun agent and the workers they forked: none is a descendant of the agent."""
    servers = warm_server_pids(agent_pid)
    return sorted({*servers, *(pid for server in servers for pid in descendants(server))})


def ensure_no_warm_servers(agent_pid: int, context: str, grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for the warm-start servers of ``agent_pid`` (and their workers) to be gone; raise if not."""
    if survivors := still_running(lambda: warm_servers(agent_pid), grace_s):
        raise RuntimeError(f"{context}: the warm-start server of agent {agent_pid} or its workers are still alive: "
                           f"{survivors}; a run would share the machine with them, so the benchmark stops here")


def _tail(text: str, lines: int = OUTPUT_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Launched:
    """A process tree started by launch(); remembers every pid it ever saw."""

    proc: subprocess.Popen
    log_path: pathlib.Path
    seen_pids: set[int] = field(default_factory=set)
    # pid -> start time in clock ticks, to tell a seen process from a later one reusing its pid.
    _start_ticks_by_pid: dict[int, int] = field(default_factory=dict, repr=False)
    _tracked_at: float = field(default=float("-inf"), repr=False)  # time.monotonic() of the last refresh()

    def __post_init__(self) -> None:
        # The agent is our unreaped child, so its pid cannot have been reused yet.
        agent_stat = _read_stat(self.proc.pid)
        if agent_stat is not None:
            self._start_ticks_by_pid[self.proc.pid] = agent_stat.start_ticks
            self.seen_pids.add(self.proc.pid)

    def _is_same_live_process(self, pid: int) -> bool:
        stat = _read_stat(pid)
        return _is_live(stat) and self._start_ticks_by_pid.get(pid) == stat.start_ticks

    def refresh(self) -> set[int]:
        """Add the current descendants of the agent and of every still-live seen pid to seen_pids; return the live ones.

        Searching under seen pids too finds children that orphaned workers start after the
        agent is gone.
        """
        self._tracked_at = time.monotonic()
        roots = {pid for pid in self.seen_pids if self._is_same_live_process(pid)}
        for stat in _live_descendant_stats(roots, _all_stats()):
            # A live descendant of our tree is ours even if it reuses the pid of one seen earlier.
            self._start_ticks_by_pid[stat.pid] = stat.start_ticks
            self.seen_pids.add(stat.pid)
        return {pid for pid in self.seen_pids if self._is_same_live_process(pid)}

    def track(self) -> None:
        """refresh(), unless the last one is under TRACK_INTERVAL_S old: what the waits below call at every poll."""
        if time.monotonic() - self._tracked_at >= TRACK_INTERVAL_S:
            self.refresh()

    def output(self) -> str:
        """Current content of the log file (stdout and stderr of the agent and its workers)."""
        try:
            return self.log_path.read_bytes().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def _fail(self, message: str) -> AssertionError:
        self.kill_all()
        return AssertionError(
            f"{message}\n--- last {OUTPUT_TAIL_LINES} lines of {self.log_path} ---\n{_tail(self.output())}"
        )

    def wait(self, timeout_s: float) -> int:
        """Wait for the agent to exit and return its exit code; on timeout kill everything and fail."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.track()
            try:
                return self.proc.wait(timeout=POLL_INTERVAL_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise self._fail(
                        f"pid {self.proc.pid} ({self.proc.args!r}) still running after {timeout_s} s"
                    ) from None

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
        """Poll the log until predicate(output) is true and return the output; fail if the agent exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.track()
            agent_exit_code = self.proc.poll()
            # Read the output after poll(): whatever the agent wrote before exiting is in it.
            text = self.output()
            if predicate(text):
                return text
            if agent_exit_code is not None:
                raise self._fail(f"waiting for {what}: pid {self.proc.pid} exited with code {agent_exit_code} first")
            if time.monotonic() > deadline:
                raise self._fail(f"waiting for {what}: not seen after {timeout_s} s")
            time.sleep(POLL_INTERVAL_S)

    def kill_all(self) -> None:
        """SIGKILL the agent and every seen pid still alive, then reap the agent.

        The tree is first frozen with SIGSTOP, repeating until a refresh finds no new pid, so
        no process can start a child between being seen and being killed.
        """
        # A warm-start server is forked from a worker, so the search can adopt it in that moment; left alone, it
        # exits with its agent and removes its socket and lock file, which a SIGKILL would leave behind.
        servers = set(warm_server_pids(self.proc.pid))
        stopped: set[int] = set()
        while True:
            live = self.refresh() - servers
            new_pids = live - stopped
            if not new_pids:
                break
            for pid in new_pids:
                self._signal(pid, signal.SIGSTOP)
            stopped |= new_pids
        for pid in stopped:
            self._signal(pid, signal.SIGKILL)
        self.proc.wait()
        # SIGKILL is delivered asynchronously: wait (briefly) so that leftover_pids() right
        # after kill_all() reports only processes that really survived.
        deadline = time.monotonic() + KILL_SETTLE_S
        while self.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.01)

    @staticmethod
    def _signal(pid: int, signum: signal.Signals) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def leftover_pids(self) -> list[int]:
        """Seen pids (the agent included) still alive, not counting zombies."""
        return sorted(pid for pid in self.seen_pids if self._is_same_live_process(pid))


_launched_registry: list[Launched] = []


def launch(
    args: list[str],
    *,
    log_path: pathlib.Path,
    env: dict[str, str] | None = None,
    cwd: pathlib.Path | None = None,
) -> Launched:
    """Start args in a new session with stdout and stderr to log_path, and register it for kill_all_launched().

    The child's environment is os.environ updated with env.
    """
    child_env = dict(os.environ)
    child_env.update(env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
        )
    launched = Launched(proc=proc, log_path=log_path)
    _launched_registry.append(launched)
    return launched


def kill_all_launched() -> None:
    """kill_all() every process tree started by launch() since the last call, and forget them."""
    while _launched_registry:
        _launched_registry.pop().kill_all()


atexit.register(kill_all_launched)


@contextmanager
def cpu_burners(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` CPU-bound processes (a Python busy loop each, in sessions of their own) for the block's length: a
    loaded machine. Each is SIGKILLed by its pid and reaped as the block ends."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(count)]
    try:
        yield burners
    finally:
        for burner in burners:
            os.kill(burner.pid, signal.SIGKILL)
            burner.wait()


def reap_fixture() -> Iterator[None]:
    """Body of an autouse fixture: after the test, kill every launched tree and fail if any process survives.

    tests/conftest.py wraps it: ``yield from procs.reap_fixture()``.
    """
    yield
    launched_in_test = list(_launched_registry)
    kill_all_launched()
    deadline = time.monotonic() + REAP_GRACE_S
    leftovers = {id(launched): launched.leftover_pids() for launched in launched_in_test}
    while any(leftovers.values()) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        leftovers = {id(launched): launched.leftover_pids() for launched in launched_in_test}
    survivors = {
        str(launched.proc.args): leftovers[id(launched)] for launched in launched_in_test if leftovers[id(launched)]
    }
    assert not survivors, f"processes still alive {REAP_GRACE_S} s after SIGKILL: {survivors}"


def wait_for_file(path: pathlib.Path, timeout_s: float, launched: Launched | None = None) -> str:
    """Poll until path exists and is non-empty and return its text; fail on timeout or if launched exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if launched is not None:
            launched.track()
            agent_exit_code = launched.proc.poll()
        else:
            agent_exit_code = None
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        if text:
            return text
        if agent_exit_code is not None:
            raise launched._fail(f"waiting for {path}: pid {launched.proc.pid} exited with code {agent_exit_code} first")
        if time.monotonic() > deadline:
            message = f"waiting for {path}: still missing or empty after {timeout_s} s"
            if launched is not None:
                raise launched._fail(message)
            raise AssertionError(message)
        time.sleep(POLL_INTERVAL_S)
