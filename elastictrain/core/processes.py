"""What /proc says of a process: its state letter and start time; which of some processes are stopped; the
signal a process gets when its parent exits.

Torch-free: the watchdog (health/hangs.py), elastictrain-run's agent and the warm-start client read it.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process from /proc, or None (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            raw = stat_file.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[19])


def stopped_pids(pids: list[int], stat: Callable[[int], tuple[str, int] | None] = proc_stat) -> list[int]:
    """The processes among ``pids`` that are stopped (SIGSTOP, a debugger's stop): a SIGTERM cannot reach them.

    torch 2.13's agent stops a failed group on a restart with SIGTERM and waits 30 s before its
    SIGKILL, whatever ``--shutdown-timeout`` says; elastictrain-run's agent and the warm-start
    client SIGKILL these instead, as a frozen rank whose peers are on other nodes has no peer here
    to do it.
    """
    return [pid for pid in pids if (state := stat(pid)) is not None and state[0] in ("T", "t")]


PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2  # <linux/prctl.h>


def parent_death_signal(signum: int | None = None) -> int | None:
    """The signal this process gets when its parent exits (Linux's ``PR_SET_PDEATHSIG``); set it first if ``signum``.

    Returns the setting before this call (0: none), or None where there is no such setting (not Linux). The kernel
    clears it in a forked child and keeps it across ``exec``. Under torchrun the parent is the agent: a worker
    whose agent is SIGKILLed goes on as an orphan that nothing will restart or signal again.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    current = ctypes.c_int(0)
    if libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(current), 0, 0, 0) != 0:
        return None
    if signum is not None and libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return None
    return current.value
