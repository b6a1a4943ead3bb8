"""The observer that feeds trackers the run's history, each (name, step) once, and the tracker run id it keeps."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..config import Config
from ..events import Observer, Observers, SnapshotReport
from ..states import State
from .ids import TrackingIds

if TYPE_CHECKING:
    from ..runstate import RunState

log = logging.getLogger("elastictrain")

NOT_METRICS = ("step", "epoch")


class Backend(Protocol):
    name: str

    def open(self, ids: TrackingIds, store: Any) -> bool:
        """Find or create the tracker run; True when it was created now."""

    def written(self) -> dict[str, int]:
        """The highest step stored per name (what an earlier attempt already wrote)."""

    def write(self, points: list[tuple[str, int, float]]) -> None: ...

    def mark_restart(self, step: int, attempt: int, reason: str) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_summary(self, summary: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def metric_points(record: dict[str, Any]) -> list[tuple[str, float]]:
    return [(name, float(value)) for name, value in sorted(record.items())
            if name not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)]


class Tracking(Observer):
    """Rank 0's trackers: history records once a snapshot of their step has committed, restarts as markers.

    A tracker that fails (a server down, a wrong URI) is said in one line and switched off; the run goes on.
    """

    def __init__(self, backends: list[Backend], run: "RunState", config: dict[str, Any]) -> None:
        self.backends, self.run, self.config = backends, run, config
        self.written: dict[str, dict[str, int]] = {}  # backend -> name -> highest step stored
        self.store: Any = None
        self.cursor = 0  # history records before it are written (or skipped)

    def started(self, info: Any) -> None:
        self.store = info.store

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        # The history is the restored snapshot's now (or empty): read it from the start, skip what is stored.
        self.cursor = 0
        self._each("start", lambda backend: self._start(backend, step))

    def rolled_back(self, from_step: int, to_step: int, duration_s: float) -> None:
        # ROLLBACK (anomalies.py) put back an older history: read it from the start too, skipping what is stored.
        self.cursor = 0

    def snapshotted(self, report: SnapshotReport) -> None:
        if report.committed:
            self._write_through(report.step)

    def transition(self, src: State, dst: State, step: int) -> None:
        if dst is State.DONE:  # the end: every record is final (and the last snapshot holds it)
            self._write_through(None)
            summary = self._summary()
            self._each("the summary", lambda backend: backend.log_summary(summary, step))

    def closed(self) -> None:
        self._each("close", lambda backend: backend.close())

    def _start(self, backend: Backend, step: int) -> None:
        if backend.name not in self.written:
            if backend.open(self.run.tracking, self.store):
                backend.log_config(self.config)
            self.written[backend.name] = backend.written()
        attempts = self.run.run_log.attempts
        # A restart before the first snapshot starts fresh: only the launcher's count tells it from a first start.
        if len(attempts) > 1 or attempts[-1]["restart_count"] > 0:
            reason = attempts[-1]["reason"]
            backend.mark_restart(step, len(attempts), "restart before the first snapshot" if reason == "fresh" else reason)

    def _write_through(self, step: int | None) -> None:
        records = self.run.history.records
        end = self.cursor
        while end < len(records) and (step is None or records[end]["step"] <= step):
            end += 1
        self._each("a write", lambda backend: self._write(backend, records[self.cursor:end]))
        self.cursor = end

    def _write(self, backend: Backend, records: list[dict[str, Any]]) -> None:
        stored = self.written[backend.name]
        latest, points = dict(stored), []
        for record in records:
            for name, value in metric_points(record):
                if record["step"] > latest.get(name, -1):  # each (name, step) once, whatever an attempt replays
                    points.append((name, record["step"], value))
                    latest[name] = record["step"]
        if points:
            backend.write(points)
            stored.update(latest)  # only once written: a failed write is retried by the next attempt

    def _each(self, what: str, call: Callable[[Backend], None]) -> None:
        for backend in list(self.backends):
            try:
                call(backend)
            except Exception as exc:  # the tracker's store, not training: one line, and the run goes on
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("track: %s failed in %s (%s: %s) and is switched off for this attempt; the run goes on and "
                            "the next attempt writes what this one could not", backend.name, what,
                            type(exc).__name__, first_line)
                log.debug("track: %s failed", backend.name, exc_info=True)
                self.backends.remove(backend)

    def _summary(self) -> dict[str, Any]:
        progress, history = self.run.progress, self.run.history
        last = {name: value for record in history.records for name, value in metric_points(record)}
        return {"global_step": progress.global_step, "epoch": progress.epoch,
                "attempts": len(self.run.run_log.attempts), **last}


def attach_trackers(cfg: Config, events: Observers, run: "RunState") -> None:
    """Rank 0's trackers from ``track.*`` (none by default)."""
    track = cfg.track
    backends: list[Backend] = []
    if track.tensorboard:
        from .tensorboard_backend import TensorBoardBackend

        backends.append(TensorBoardBackend(track.tensorboard_dir or f"{cfg.run_dir}/tensorboard"))
    if track.mlflow_uri:
        from .mlflow_backend import MlflowBackend

        backends.append(MlflowBackend(track.mlflow_uri, track.mlflow_experiment or cfg.run.name, cfg.run.name))
    if backends:
        events.add(Tracking(backends, run, cfg.to_dict(redact=True)))
