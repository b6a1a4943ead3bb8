"""The client of warm restarts: the process torchrun started, standing in for the child the server forks.

It hands the node's server its arguments, environment, working directory and standard streams, then
stays while the child runs: it forwards every signal torchrun sends (a SIGTERM to a stopped child as
SIGKILL: it could not act on it), answers for the agent's exit (the child's own parent is the server),
and exits as the child did. Standard library only. How the pieces fit: the docstring of warmstart.py.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

from elastictrain.core.processes import parent_death_signal, proc_stat, stopped_pids
from elastictrain.core.signals import LAUNCHER_EXIT_SIGNAL
from elastictrain.launcher.warm_protocol import REQUEST_TIMEOUT_S, peer_uid, receive_message, say, send_message

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def connect(path: str) -> socket.socket | None:
    """A connection to the server at ``path``, or None: no server (yet), or one of another user."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:  # no server yet, or a stale socket of one that died
        connection.close()
        return None
    if peer_uid(connection) != os.getuid():  # never hand the environment to another user's process
        connection.close()
        say(f"{path} is served by another user: this start runs cold")
        return None
    return connection


def run_warm(
    connection: socket.socket, module: str | None, script: str | None, args: list[str] | tuple[str, ...]
) -> None:
    """Have the server fork the worker, stand in for it, and end as it ended. Returns only if no child started: the
    signals are then back as they were (a stop torchrun already asked for has ended this process), to start cold."""
    child: dict[str, Any] = {"pid": None, "pending": [], "agent_gone": False}

    def forward(signum: int, _frame: object) -> None:
        if child["pid"] is None:
            child["pending"].append(signum)
        else:
            # A stopped (frozen) child cannot act on SIGTERM, and torchrun waits 30 s before its SIGKILL.
            stopped = signum == signal.SIGTERM and stopped_pids([child["pid"]])
            try:
                os.kill(child["pid"], signal.SIGKILL if stopped else signum)
            except ProcessLookupError:
                pass

    def agent_exited(_signum: int, frame: object) -> None:  # the kernel sends it once per agent thread that ends
        if not child["agent_gone"]:
            child["agent_gone"] = True
            say("the torchrun agent exited: SIGTERM to the worker, which stops at an agreed step with a snapshot")
            forward(signal.SIGTERM, frame)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    if LAUNCHER_EXIT_SIGNAL is not None:  # the worker's own parent is the server: this client answers for the agent
        signal.signal(LAUNCHER_EXIT_SIGNAL, agent_exited)
        parent_death_signal(LAUNCHER_EXIT_SIGNAL)
    streams = {
        "line_buffering": bool(getattr(sys.stdout, "line_buffering", False)),
        "write_through": bool(getattr(sys.stdout, "write_through", False)),
    }
    request = {
        "module": module,
        "script": script,
        "args": list(args),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "streams": streams,
        "client_started": process_started_unix(),
    }
    try:
        connection.settimeout(REQUEST_TIMEOUT_S)
        send_message(connection, request, [0, 1, 2])
        started, _ = receive_message(connection)
        connection.settimeout(None)
    except OSError as error:
        started = None
        say(f"the preloaded interpreter did not answer ({error})")
    if not started or "pid" not in started:  # nothing runs yet: start cold instead, with the signals back as they were
        if started:
            say(f"the preloaded interpreter refused to fork ({started['cold']})")
        connection.close()
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        parent_death_signal(0)  # the cold worker asks for its own (core/signals.py)
        for signum in child["pending"]:  # torchrun already asked this worker to stop
            os.kill(os.getpid(), signum)
        say("this start runs cold")
        return
    child["pid"] = started["pid"]
    for signum in child["pending"]:
        os.kill(child["pid"], signum)
    ended, _ = receive_message(connection)
    if ended is None:  # the server went away (its agent exited): nobody reads this status
        os._exit(1)
    exit_like(ended["status"])


def process_started_unix(pid: int | None = None) -> float:
    """When process ``pid`` (default: this one) was created (fork or exec), as a unix time."""
    stat = proc_stat(os.getpid() if pid is None else pid)
    if stat is None:
        raise ProcessLookupError(pid)
    age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - stat[1] / os.sysconf("SC_CLK_TCK")
    return time.time() - age_s


def exit_like(status: int) -> None:
    """End this process as the one with wait status ``status`` ended: the same signal, or the same code."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        time.sleep(5)  # a signal whose default is not to end the process: end with its shell code
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))
