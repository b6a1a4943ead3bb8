"""A tracker's calls on a thread of its own: training never waits for a tracker's server.

``TrackerThread`` builds its backend (the import of mlflow or tensorboard, seconds of it) and makes
every call in the order it was submitted. A call that fails (a server down or hung: the client's own
timeout ends it) is retried with a growing pause until it succeeds, so an outage delays the tracker's
points, not training, and they are written once the server answers. One warning line names the
tracker when an outage starts, one when it ends. Calls wait in a bounded queue; past ``max_pending``
the newest are dropped with one warning (the run's history keeps them for the next attempt).
``close`` waits for the queue while the tracker answers, and gives up after one more try when it does not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from elastictrain.core.errors import one_line

log = logging.getLogger("elastictrain")

MAX_PENDING = 10_000  # calls (each a snapshot's points, a marker, the summary) waiting for the tracker
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0
CLOSE_IDLE_S = 30.0  # at close, give up once no call has finished for this long
CLOSE_DOWN_S = 2.0  # or, while it does not answer, after one more try (right away) and this long
_CLOSE = object()


class TrackerThread:
    """Run ``make_backend()`` and then each submitted ``call(backend)`` in order, on a daemon thread."""

    def __init__(
        self,
        name: str,
        make_backend: Callable[[], Any],
        max_pending: int = MAX_PENDING,
        retry_first_s: float = RETRY_FIRST_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self.name, self._make_backend = name, make_backend
        self._calls: queue.Queue = queue.Queue(maxsize=max_pending)
        self._retry_first_s, self._retry_max_s = retry_first_s, retry_max_s
        self._closing = threading.Event()
        self._wake = threading.Event()  # cuts a pause between two tries short (close)
        self.down_since: float | None = None  # monotonic time the current outage began
        self.dropped = 0
        self._all_made = False  # every call up to close() was made
        self.progressed = time.monotonic()  # the last call that finished (or the start)
        self._thread = threading.Thread(target=self._run, name=f"elastictrain-track-{name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, call: Callable[[Any], None]) -> None:
        """Queue ``call(backend)``; never blocks."""
        try:
            self._calls.put_nowait((what, call))
        except queue.Full:
            if not self.dropped:
                log.warning(
                    "track: %s has %d calls waiting (its server is not answering); newer points are dropped "
                    "from its queue (the run's history keeps them)",
                    self.name,
                    self._calls.qsize(),
                )
            self.dropped += 1

    @property
    def pending(self) -> int:
        return self._calls.qsize()

    def close(self, idle_s: float = CLOSE_IDLE_S, down_s: float = CLOSE_DOWN_S) -> bool:
        """Wait for the queued calls while the tracker answers; True when all were made."""
        try:
            self._calls.put_nowait((None, _CLOSE))
        except queue.Full:
            pass
        self._wake.set()  # a tracker that is down is tried again now
        started = time.monotonic()
        while self._thread.is_alive():
            now = time.monotonic()
            if now - self.progressed > idle_s or (self.down_since is not None and now - started > down_s):
                break
            self._thread.join(timeout=0.05)
        self._closing.set()
        self._wake.set()
        if not self._all_made:
            log.warning(
                "track: %s did not answer; %d calls of this attempt are not made (its points are in the "
                "run's snapshots: the next attempt writes them)",
                self.name,
                self._calls.qsize() + 1,
            )
        return self._all_made

    def _run(self) -> None:
        backend = self._attempt("start", lambda _: self._make_backend(), None)
        while not self._closing.is_set():
            what, call = self._calls.get()
            if call is _CLOSE:
                self._all_made = True
                return
            if backend is None:
                backend = self._attempt("start", lambda _: self._make_backend(), None)
                if backend is None:
                    return
            self._attempt(what, call, backend)

    def _attempt(self, what: str, call: Callable[[Any], Any], backend: Any) -> Any:
        """``call(backend)`` until it succeeds (its result) or the thread is closing (None)."""
        pause_s = self._retry_first_s
        while True:
            began = time.monotonic()
            try:
                result = call(backend)
            except Exception as exc:  # the tracker's store, not training's: say so once per outage, retry
                if self.down_since is None:
                    self.down_since = began  # a hung server: since the request that timed out was sent
                    log.warning(
                        "track: %s failed in %s (%s); training goes on, its points wait and are written when "
                        "it answers (retried every %.0f s at most)",
                        self.name,
                        what,
                        one_line(exc, limit=200, kind=True),
                        self._retry_max_s,
                    )
                    log.debug("track: %s failed", self.name, exc_info=True)
                if self._wake.wait(pause_s):
                    self._wake.clear()  # one try now, then the pauses again
                if self._closing.is_set():
                    return None
                pause_s = min(pause_s * 2, self._retry_max_s)
                continue
            if self.down_since is not None:
                log.warning(
                    "track: %s answers again after %.0f s; %d calls were waiting",
                    self.name,
                    time.monotonic() - self.down_since,
                    self._calls.qsize() + 1,
                )
                self.down_since = None
            self.progressed = time.monotonic()
            return result if result is not None else True
