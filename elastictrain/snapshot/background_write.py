"""Snapshot writes in the background: at most one in flight per tier, its outcome read on the training thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastictrain.core.events import SnapshotReport, Tier

log = logging.getLogger("elastictrain")


@dataclass(frozen=True)
class CommitOutcome:
    """What one snapshot write came to, as rank 0 tells every rank: committed or not, and whether the run stops.

    The default, nothing committed and no error, is a write still to come: started in the
    background, or one whose outcome another rank (rank 0) reports.
    """

    committed: bool = False
    size_bytes: int = 0
    error: str | None = None  # one line, when not committed
    stop: bool = False  # the failure stops the run (snapshot.durable.on_error=stop, a lost lease, a failed write)

    def report(self, step: int, duration_s: float, tier: Tier, write_s: float = 0.0) -> SnapshotReport:
        """The event observers are told of this write."""
        return SnapshotReport(step, self.committed, duration_s, self.size_bytes, self.error, write_s, tier)


PENDING = CommitOutcome()


class BackgroundWrite:
    """One snapshot written by a daemon thread; its outcome is read on the training thread after ``join``."""

    def __init__(self, step: int, blocked_s: float, write: Any) -> None:
        self.step = step
        self.blocked_s = blocked_s  # training blocked to stage it
        self.write_s = 0.0
        self.outcome: CommitOutcome | None = None  # what Snapshotter._commit returns
        self.crash: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(write,), name=f"elastictrain-snapshot-{step}", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self, write: Any) -> None:
        started = time.monotonic()
        try:
            self.outcome = write()
        except BaseException as exc:  # reported on the training thread, never lost
            log.exception("the background snapshot write of step %d crashed", self.step)
            self.crash = exc
        finally:
            self.write_s = time.monotonic() - started

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class BackgroundWrites:
    """One tier's background writes, one at a time: the one in flight, the reports not yet polled, and a failure.

    ``failed`` (a write failed for good, or crashed) makes the run stop at the next vote;
    ``crash`` keeps a crashed writer's exception so its traceback is raised where it is reported.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.in_flight: BackgroundWrite | None = None
        self.failed: str | None = None
        self.crash: BaseException | None = None
        self._reports: list[SnapshotReport] = []  # finished background writes not yet reported

    def start(self, step: int, blocked_s: float, write: Callable[[], CommitOutcome]) -> None:
        self.in_flight = BackgroundWrite(step, blocked_s, write)

    def join(self) -> None:
        """Wait for the write in flight; its report waits for ``poll``."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return
        flight.join()
        if flight.crash is not None:
            self.crash = flight.crash
            self.failed = f"the background snapshot write of step {flight.step} crashed: {flight.crash!r}"
            self._reports.append(
                SnapshotReport(flight.step, False, flight.blocked_s, 0, self.failed, flight.write_s, self.tier)
            )
            return
        assert flight.outcome is not None  # the write returned (no crash)
        outcome = flight.outcome
        if outcome.stop:
            self.failed = outcome.error
        self._reports.append(outcome.report(flight.step, flight.blocked_s, self.tier, flight.write_s))

    def poll(self) -> list[SnapshotReport]:
        """The reports of writes finished since the last poll."""
        if self.in_flight is not None and not self.in_flight.running:
            self.join()
        reports, self._reports = self._reports, []
        return reports

    def abandon(self, timeout_s: float) -> None:
        """Leaving for any reason: give the write in flight ``timeout_s`` to finish, and report nothing."""
        if self.in_flight is not None:
            self.in_flight.join(timeout=timeout_s)
            self.in_flight = None
