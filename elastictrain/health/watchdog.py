"""Hung ranks: a rank that stops making progress is named within seconds and the group restarts.

Without this, a worker that stops (SIGSTOP, a deadlock in user code, a collective that never
completes) leaves its peers blocked until ``dist.collective_timeout_s`` (minutes). ``Watchdog``
is an observer with a daemon thread on every rank that

- publishes this rank's heartbeat (step, state, unix time, where its loop thread is) to the
  launcher's store every ``heartbeat_every_s``; under torchrun the agent hosts that store, so it
  stays up when a worker is frozen or dead;
- checks this rank's own progress: when the step has not moved for longer than the allowance of
  the current state, it reads every rank's heartbeat, logs ONE line naming the rank(s) that
  stopped and their state, dumps every thread's stack to stderr and leaves with
  ``HUNG_EXIT_CODE`` through ``os._exit`` (the loop thread may be blocked inside a C++
  collective, where no exception can reach it). The launcher then restarts the group from the
  newest snapshot.

A frozen rank cannot act, but its peers stall at the same moment and their watchdogs do; a rank
stuck in its own code is caught by its own watchdog as well as by its peers'. A stalled rank
does not wait out the allowance for a peer that is frozen or gone: once its own step is overdue
it reads the peers' heartbeats every period, and a peer whose heartbeat has not changed for a few
periods (by this rank's clock: ``SilentPeers``) ends the wait at once; on this host, a peer whose
heartbeat has not changed across two reads and whose process is stopped ends it at the second read
(``hangs.frozen_peers``). A stall counts from the time the loop read with its last beat, and "overdue" is twice the recent
step (not the longest, such as a warm-up's). A peer stopped on this host is SIGKILLed, so the launcher sees a dead worker at once; a frozen peer on another host is
left to its own agent, which the group's new rendezvous round makes restart its workers. After such a kill the
rank's own blocked collective fails at once, and the loop thread leaves through its failure path (a survivor copy
of the step); the watchdog exits the process itself only if that has not happened within ``leave_grace_s``.

The allowance adapts so a slow model is no false alarm: in TRAIN it is the larger of
``hang_timeout_s`` and ``step_multiple`` times the longest time between progress marks seen in
this attempt; the first step, RESTORE, EVALUATE and SNAPSHOT have longer allowances of their own,
also stretched to ``step_multiple`` times the longest such state seen.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from elastictrain.core.events import Observer, RunInfo, TrainInterval
from elastictrain.core.processes import proc_stat
from elastictrain.core.states import TERMINAL, State
from elastictrain.health.hangs import (
    Heartbeat,
    SilentPeers,
    WatchdogSettings,
    allowance_s,
    diagnose,
    frozen_peers,
    is_stopped_here,
    loop_position,
    overdue_after_s,
    stall_poll_s,
)

log = logging.getLogger("elastictrain")

# sysexits' EX_TEMPFAIL: "a temporary failure; the user is invited to retry" — a restart.
HUNG_EXIT_CODE = 75


def _leave(code: int) -> None:
    """Dump every thread's stack to stderr and end the process now, from any thread."""
    for handler in log.handlers:
        handler.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(code)


class Watchdog(Observer):
    """Detects a rank that stopped making progress, names it, and turns the hang into a restart.

    Wire it on every rank as an observer; call ``beat(step)`` once per optimizer step from the
    loop (an attribute write) so hangs are seen at step granularity. Without ``beat`` the log
    intervals (``trained``) are the progress marks, and the allowance adapts to their length.
    """

    # After SIGKILLing a stopped peer: how long the loop thread has to leave through its own failure path.
    leave_grace_s = 5.0

    def __init__(
        self,
        settings: WatchdogSettings = WatchdogSettings(),
        *,
        clock: Callable[[], float] = time.monotonic,
        on_hang: Callable[[int], None] = _leave,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._on_hang = on_hang
        self._info: RunInfo | None = None
        self._loop_thread: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Written by the loop thread, read by the watchdog thread: single attribute writes.
        self._beat_step: int | None = None
        self._trained_count = 0
        self._state_visit = (State.SETUP, 0, clock())  # (state, step, entered at)
        self._step = 0
        # The watchdog thread's own bookkeeping.
        self._seen_marks: tuple[int | None, int] = (None, 0)  # (beat step, trained count) at the last check
        self._last_progress = clock()
        self._trained_once = False
        self._longest_step_s = 0.0
        self._recent_step_s = 0.0  # the mean step of the last check that saw steps: when to read the peers
        self._beat_at: float | None = None
        self._longest_state_s: dict[State, float] = {}
        self._start_ticks = 0
        self._to_kill: list[Heartbeat] = []
        self._silence = SilentPeers(clock)
        self._silent_peers: list[tuple[Heartbeat, float]] = []  # check()'s verdict: these peers went silent
        self._overdue = False  # check()'s: this rank's step is overdue, so the thread polls every stall_poll_s

    # -- events (loop thread) ---------------------------------------------------------------

    def started(self, info: RunInfo) -> None:
        self._info = info
        self._loop_thread = threading.get_ident()
        if not self.settings.enabled:
            return
        self._start_ticks = (proc_stat(os.getpid()) or ("", 0))[1]
        self._publish()  # at once: a rank frozen before the first period must still be known
        self._thread = threading.Thread(target=self._run, name="elastictrain-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """One optimizer step is done: call once per step (no lock, no system call)."""
        self._beat_at = self._clock()  # first: a reader that sees the new step sees its time
        self._beat_step = step

    def transition(self, src: State, dst: State, step: int) -> None:
        now = self._clock()
        state, _, entered = self._state_visit
        if state is src:
            self._longest_state_s[src] = max(self._longest_state_s.get(src, 0.0), now - entered)
        self._step = step
        self._state_visit = (dst, step, now)
        if dst in TERMINAL:
            self.stop()
        elif self._thread is not None:
            self._publish()  # a state change is news for the peers (one store set; transitions are rare)

    def trained(self, interval: TrainInterval) -> None:
        self._step = interval.step
        if interval.step_time_s_by_rank:  # the slowest rank sets everyone's pace
            self._longest_step_s = max(self._longest_step_s, max(interval.step_time_s_by_rank))
        self._trained_count += 1

    def closed(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop watching (terminal state, or the worker is leaving); publishes a last heartbeat."""
        if self._stop.is_set():
            return
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.settings.heartbeat_every_s + 1)
            self._publish()

    # -- the watchdog thread ----------------------------------------------------------------

    def _run(self) -> None:
        published = self._clock()
        while not self._stop.wait(stall_poll_s(self.settings) if self._overdue else self.settings.heartbeat_every_s):
            if self._clock() - published >= self.settings.heartbeat_every_s - 1e-3:
                self._publish()
                published = self._clock()
            verdict = self.check()
            if verdict is not None and not self._stop.is_set():
                self._fire(verdict)
                return

    def check(self) -> str | None:
        """Take note of progress; return why this rank counts as hung, or None while it is fine."""
        now = self._clock()
        state, step, entered = self._state_visit
        marks = (self._beat_step, self._trained_count)
        if marks != self._seen_marks:
            beat_now, trained_now = marks
            beat_then, trained_then = self._seen_marks
            if beat_now is not None:
                advanced = beat_now - beat_then if beat_then is not None else 1
            else:
                advanced = trained_now - trained_then
            since = max(self._last_progress, entered)
            # When the last step ended: the loop's own clock reading with its beat (a stall counts from there, not
            # from this check, up to a period later), else now.
            at = self._beat_at if beat_now is not None and self._beat_at is not None else now
            at = min(max(at, since), now)
            if state is State.TRAIN and advanced > 0:  # the first step too: a slow warm-up only lengthens the allowance
                self._recent_step_s = (at - since) / advanced
                self._longest_step_s = max(self._longest_step_s, self._recent_step_s)
                self._trained_once = True
            self._seen_marks, self._last_progress = marks, at
        allowed = allowance_s(
            self.settings,
            state,
            trained_once=self._trained_once,
            longest_step_s=self._longest_step_s,
            longest_state_s=self._longest_state_s.get(state, 0.0),
        )
        if allowed is None:
            return None
        stalled_s = now - max(self._last_progress, entered)
        if stalled_s > allowed:
            return f"no progress for {stalled_s:.1f} s in state {state.name} at step {self._current_step()} (allowed {allowed:.1f} s)"
        # Overdue (a poll, and twice the recent step): a silent peer will not come back. The peers are read from
        # then on every poll; a peer's staleness still counts only from a heartbeat period into the stall, as a
        # slow peer's heartbeat thread may lag under load, while a stopped peer on this host is named at once.
        # (Reading them is all being overdue does: the recent step, not the longest, such as a warm-up's.)
        overdue = overdue_after_s(self.settings, self._recent_step_s)
        self._overdue = stalled_s >= overdue
        if self._overdue:
            silent = frozen_peers(
                self._silence.update(self._peer_heartbeats()),
                self._stale_after_s(),
                is_stopped_here,
                stalled_s,
                self.settings.heartbeat_every_s,
            )
            if silent:
                self._silent_peers = silent
                return (
                    f"no progress for {stalled_s:.1f} s in state {state.name} at step {self._current_step()} and "
                    + (
                        "; ".join(
                            f"rank {beat.rank}'s heartbeat has not changed for {s:.1f} s"
                            + (" and its process is stopped on this host" if is_stopped_here(beat) else "")
                            for beat, s in silent
                        )
                    )
                )
        else:
            self._silence.forget()
        # Stalled for a while, and a peer has already found the hang: leave with it now, before
        # its exit turns this rank's collective into a connection error that says less.
        peer_verdict = self._peer_verdict() if stalled_s > allowed / 2 else None
        if peer_verdict is not None:
            return f"no progress for {stalled_s:.1f} s in state {state.name} at step {self._current_step()} and {peer_verdict}"
        return None

    def _fire(self, verdict: str) -> None:
        info = self._info
        rank = info.rank if info is not None else 0
        try:
            stopped = self._diagnose()
        except Exception as exc:  # the store's host may be gone with the hang
            stopped = f"cannot read the other ranks' heartbeats ({type(exc).__name__}: {exc})"
        self._set(self._verdict_key(), f"rank {rank} found a hang: {stopped}")
        log.error(
            "rank %d: %s; %s; exiting with code %d so the launcher restarts the group from the newest snapshot "
            "(stack of every thread below)",
            rank,
            verdict,
            stopped,
            HUNG_EXIT_CODE,
        )
        # Peers stalled at the same moment; give their watchdogs a moment to say what they see
        # before this rank's exit turns their collectives into connection errors. Not for a
        # silent peer: every live rank sees its silence by itself, and the launcher waits for it.
        if not self._silent_peers:
            self._stop.wait(2 * self.settings.heartbeat_every_s)
        killed = False
        for beat in self._to_kill:  # last: its death turns this rank's own collective into an error
            try:
                os.kill(beat.pid, signal.SIGKILL)
                killed = True
            except OSError:
                pass
        # That error reaches the loop thread at once, whose failure path writes a survivor copy of the step (survivor.py)
        # and ends the process: leaving now would lose the steps since the last timed copy. Only if it has not
        # stopped this watchdog within the grace does this rank leave as a hung one.
        if killed and self._stop.wait(self.leave_grace_s):
            return
        self._on_hang(HUNG_EXIT_CODE)

    # -- heartbeats -------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """This rank's heartbeat now."""
        state, step, _ = self._state_visit
        if self._stop.is_set() and state not in TERMINAL:
            state = State.FAILED  # leaving without a terminal transition
        shown = self._current_step()
        where, waiting = loop_position(self._loop_thread)
        return Heartbeat(
            rank=self._info.rank if self._info else 0,
            step=shown,
            state=state.name,
            unix=time.time(),
            waiting=waiting,
            where=where,
            pid=os.getpid(),
            host=socket.gethostname(),
            start_ticks=self._start_ticks,
        )

    def _current_step(self) -> int:
        beat = self._beat_step if self._state_visit[0] is State.TRAIN and self._beat_step is not None else 0
        return max(beat, self._state_visit[1], self._step)

    def _peer_heartbeats(self) -> dict[int, Heartbeat | None]:
        """Every other rank's latest heartbeat (None: none published yet); {} when the store cannot be read."""
        info = self._info
        if info is None or info.store is None:
            return {}
        try:
            return self._read_heartbeats()
        except Exception:  # the agent (and its store) may be gone: the allowance still holds
            log.debug("watchdog could not read the peers' heartbeats", exc_info=True)
            return {}

    def _read_heartbeats(self) -> dict[int, Heartbeat | None]:
        """Every other rank's latest heartbeat from the store (None: none published yet); store errors propagate."""
        info = self._info
        assert info is not None and info.store is not None  # _peer_heartbeats checked
        keys = {rank: self._key(rank) for rank in range(info.world_size) if rank != info.rank}
        if not keys:
            return {}
        if info.store.check(list(keys.values())):  # all there: one round trip
            return {
                rank: Heartbeat.from_json(raw) for rank, raw in zip(keys, info.store.multi_get(list(keys.values())))
            }
        return {
            rank: Heartbeat.from_json(info.store.get(key)) if info.store.check([key]) else None
            for rank, key in keys.items()
        }

    def _diagnose(self) -> str:
        info = self._info
        own = self.heartbeat()
        if info is None or info.store is None:
            return f"rank {own.rank} (alone) is stuck at {own.where}"
        peers = self._read_heartbeats()
        heartbeats = {rank: own if rank == info.rank else peers[rank] for rank in range(info.world_size)}
        now_unix, stale_after_s = time.time(), self._stale_after_s()
        silent_ranks = {beat.rank for beat, _ in self._silent_peers}
        self._to_kill = [
            beat
            for beat in heartbeats.values()
            if beat is not None
            and beat.rank != own.rank
            and (now_unix - beat.unix > stale_after_s or beat.rank in silent_ranks)
            and is_stopped_here(beat)
        ]
        verdict = diagnose(heartbeats, now_unix, stale_after_s, stopped=frozenset(beat.rank for beat in self._to_kill))
        if self._to_kill:
            verdict += (
                " ("
                + ", ".join(f"rank {b.rank} is stopped process {b.pid} on this host" for b in self._to_kill)
                + (": SIGKILL, so the launcher need not wait for it to obey SIGTERM)")
            )
        return verdict

    def _stale_after_s(self) -> float:
        return max(3 * self.settings.heartbeat_every_s, 2.0)

    def _publish(self) -> None:
        self._set(self._key(self._info.rank) if self._info else "", self.heartbeat().to_json())

    def _peer_verdict(self) -> str | None:
        info = self._info
        if info is None or info.store is None:
            return None
        try:
            key = self._verdict_key()
            return info.store.get(key).decode() if info.store.check([key]) else None
        except Exception:
            return None

    def _set(self, key: str, value: str) -> None:
        info = self._info
        if info is None or info.store is None:
            return
        try:
            info.store.set(key, value)
        except Exception:  # the agent (and its store) may be gone: the self-check still works
            log.debug("watchdog could not write %s", key, exc_info=True)

    def _key(self, rank: int) -> str:
        return f"watchdog/round-{self._info.round_id if self._info else 0}/rank-{rank}"

    def _verdict_key(self) -> str:
        return f"watchdog/round-{self._info.round_id if self._info else ''}/hang"
