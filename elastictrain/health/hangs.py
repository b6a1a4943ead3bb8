"""When a rank counts as hung, and which rank stopped: allowances, heartbeats and their diagnosis.

The ``Watchdog`` thread (watchdog.py) acts; these decide. Apart from reading ``/proc`` and the loop
thread's innermost frame they are pure functions of their arguments, tested as tables.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from elastictrain.core.processes import proc_stat
from elastictrain.core.states import TERMINAL, State

# Where the innermost frame of a rank's loop thread lies when that rank is waiting for its peers
# rather than computing: inside a collective, or in backward (DDP's gradient all-reduce).
_WAITING_MODULES = (
    "torch.distributed",
    "torch.autograd",
    "elastictrain.dist.group",
    "elastictrain.dist.collectives",
    "elastictrain.dist.ddp",
    "elastictrain.dist.vote",
    "elastictrain.dist.reduce",
)


@dataclass(frozen=True)
class WatchdogSettings:
    """How long each state may go without progress before the rank is declared hung."""

    hang_timeout_s: float = 30.0  # least allowance between two steps in TRAIN; 0 switches the watchdog off
    step_multiple: float = 10.0  # allowances are at least this many times the longest step (or state) seen
    first_step_s: float = 600.0  # until the attempt's first step is done: warm-up, compilation, data workers
    restore_s: float = 600.0  # RESTORE: reading, verifying and broadcasting the snapshot (retries included)
    evaluate_s: float = 1800.0  # one whole EVALUATE state: it has no step marks inside
    snapshot_s: float = 600.0  # one SNAPSHOT: writes retried for snapshot.durable.retry_for_s per operation, on S3
    heartbeat_every_s: float = 1.0  # heartbeat publication and self-check period

    @property
    def enabled(self) -> bool:
        return self.hang_timeout_s > 0


@dataclass(frozen=True)
class Heartbeat:
    """One rank's latest word, as published in the store."""

    rank: int
    step: int
    state: str
    unix: float  # when it was published
    waiting: bool  # its loop thread waits in a collective (not stuck in its own code)
    where: str  # innermost frame of its loop thread, "module:line in function"
    pid: int = 0
    host: str = ""
    start_ticks: int = 0  # the process's start time (/proc/<pid>/stat), to tell it from a later one with its pid

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: bytes | str) -> Heartbeat:
        return cls(**json.loads(text))


def allowance_s(
    settings: WatchdogSettings, state: State, *, trained_once: bool, longest_step_s: float, longest_state_s: float
) -> float | None:
    """Seconds ``state`` may go without progress; None where nothing is watched (terminal states).

    ``longest_step_s`` is the longest time between two progress marks seen in TRAIN;
    ``longest_state_s`` the longest visit to ``state`` seen in this attempt.
    """
    if state in TERMINAL:
        return None
    multiple = settings.step_multiple
    if state is State.TRAIN:
        if not trained_once:
            return max(settings.first_step_s, settings.hang_timeout_s)
        return max(settings.hang_timeout_s, multiple * longest_step_s)
    base = {
        State.EVALUATE: settings.evaluate_s,
        State.SNAPSHOT: settings.snapshot_s,
        State.LOCAL_SNAPSHOT: settings.snapshot_s,
    }.get(state, settings.restore_s)
    return max(base, settings.hang_timeout_s, multiple * longest_state_s)


def diagnose(
    heartbeats: dict[int, Heartbeat | None],
    now_unix: float,
    stale_after_s: float,
    stopped: frozenset[int] = frozenset(),
) -> str:
    """Which rank(s) stopped, from every rank's heartbeat: silent ones first, then ranks behind, then busy ones.

    A silent rank (no heartbeat for ``stale_after_s``, or in ``stopped``: a stopped process on this
    host whose heartbeat has not changed) is frozen, killed or lost with its host.
    Otherwise a rank behind the others' step holds them up; otherwise, at one step, the rank whose
    loop is in its own code while the others wait in a collective.
    """
    live = {
        rank: beat for rank, beat in heartbeats.items() if beat is None or beat.state not in {s.name for s in TERMINAL}
    }
    silent = [
        f"rank {rank} "
        + (
            "never sent a heartbeat"
            if beat is None
            else f"sent no heartbeat for {now_unix - beat.unix:.1f} s (last in state {beat.state} at step {beat.step})"
        )
        for rank, beat in sorted(live.items())
        if beat is None or now_unix - beat.unix > stale_after_s or rank in stopped
    ]
    if silent:
        return "; ".join(silent) + ": frozen, killed or its host is gone"
    beats = [beat for _, beat in sorted(live.items()) if beat is not None]  # none is None: those were silent
    if not beats:
        return "no rank is left running"
    top = max(beat.step for beat in beats)
    behind = [f"rank {b.rank} is behind in state {b.state} at step {b.step}" for b in beats if b.step < top]
    if behind:
        return "; ".join(behind) + f" (the others are at step {top})"
    busy = [b for b in beats if not b.waiting]
    if busy and len(busy) < len(beats):
        return "; ".join(f"rank {b.rank} is stuck in state {b.state} at step {b.step} at {b.where}" for b in busy) + (
            " while the others wait for it in a collective"
        )
    where = "; ".join(f"rank {b.rank} at {b.where}" for b in beats)
    return f"every rank stalled in state {beats[0].state} at step {top}, none silent or behind ({where})"


def is_stopped_here(beat: Heartbeat) -> bool:
    """Whether a silent peer is a *stopped* process on this host (same pid and start time): the watchdog SIGKILLs it.

    The launcher stops a failed group with SIGTERM, which a stopped process does not act on, and
    torch 2.13's agent then waits 30 s before its SIGKILL on every restart (``_stop_workers``
    ignores ``--shutdown-timeout``). The group is being restarted anyway.
    """
    if beat.host != socket.gethostname() or beat.pid <= 0 or beat.pid == os.getpid():
        return False
    stat = proc_stat(beat.pid)
    if stat is None or stat[0] not in ("T", "t") or stat[1] != beat.start_ticks:
        return False
    return True


# How often a rank whose step is overdue reads its peers' heartbeats (at most): a stopped peer on this host is
# named at the second read, so a frozen worker costs its peers about two of these, not the staleness.
STALL_POLL_S = 0.25


def stall_poll_s(settings: WatchdogSettings) -> float:
    """The watchdog's check period while this rank's step is overdue (``heartbeat_every_s`` otherwise)."""
    return min(settings.heartbeat_every_s, STALL_POLL_S)


def overdue_after_s(settings: WatchdogSettings, step_s: float) -> float:
    """How long a step may stall before this rank reads its peers: twice the recent step, and one poll."""
    return max(stall_poll_s(settings), 2 * step_s)


def frozen_peers(
    silent: list[tuple[Heartbeat, float]],
    stale_after_s: float,
    stopped_here: Callable[[Heartbeat], bool],
    stalled_s: float = float("inf"),
    heartbeat_every_s: float = 0.0,
) -> list[tuple[Heartbeat, float]]:
    """The silent peers (``SilentPeers.update``'s answer) that count as frozen, gone or killed.

    A heartbeat unchanged for ``stale_after_s`` is enough anywhere; that silence counts only from
    a heartbeat period into this rank's stall (``stalled_s``), as the peers are read from the first
    poll on. On this host the process can be asked: a peer whose heartbeat was seen unchanged
    across two reads and whose process is stopped (SIGSTOP, a debugger's stop) is frozen now;
    waiting out the staleness tells nothing more. A slow rank is never stopped: it runs, and its
    heartbeat thread publishes, so only staleness names it.
    """
    return [
        (beat, seconds)
        for beat, seconds in silent
        if min(seconds, stalled_s - heartbeat_every_s) >= stale_after_s or stopped_here(beat)
    ]


class SilentPeers:
    """Which peers' heartbeats have not changed for a while, timed by this rank's own clock.

    A heartbeat's ``unix`` time is the publisher's clock, which may be seconds off this host's;
    a heartbeat seen unchanged across reads spaced by this rank's monotonic clock is silent
    whatever the skew. Feed it the heartbeats read while this rank waits; ``forget`` on progress.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._seen: dict[int, tuple[tuple, float]] = {}  # rank -> (its heartbeat's identity, when first seen by us)

    def forget(self) -> None:
        self._seen.clear()

    def update(self, heartbeats: dict[int, Heartbeat | None]) -> list[tuple[Heartbeat, float]]:
        """Each live peer's heartbeat seen unchanged, and for how many seconds, oldest first."""
        now, silent = self._clock(), []
        for rank, beat in heartbeats.items():
            if beat is None or beat.state in {s.name for s in TERMINAL}:  # not started yet, or ended on purpose
                self._seen.pop(rank, None)
                continue
            identity = (beat.unix, beat.pid, beat.step, beat.state)
            seen = self._seen.get(rank)
            if seen is None or seen[0] != identity:
                self._seen[rank] = (identity, now)
            else:
                silent.append((beat, now - seen[1]))
        return sorted(silent, key=lambda item: -item[1])


def loop_position(thread_id: int | None) -> tuple[str, bool]:
    """Innermost frame of the loop thread as "module:line in function", and whether it waits for peers."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    try:
        if frame is None:
            return "unknown", False
        module = frame.f_globals.get("__name__", "?")
        return f"{module}:{frame.f_lineno} in {frame.f_code.co_name}", module.startswith(_WAITING_MODULES)
    finally:
        # Asked from the loop thread itself, ``frame`` is this call's own frame: kept in its own local, it would be a
        # cycle holding every caller's frame and its locals until a full collection (for ever, once frozen: heap.py).
        del frame
