"""The observer that feeds trackers the run's history, each (name, step) once, and the tracker run id it keeps."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from elastictrain.core.config import Config
from elastictrain.core.events import Observer, Observers, SnapshotReport
from elastictrain.core.states import State
from elastictrain.observe.trackers.background import TrackerThread
from elastictrain.observe.trackers.ids import TrackingIds

if TYPE_CHECKING:
    from elastictrain.core.progress import History, Progress, RunLog

log = logging.getLogger("elastictrain")


class TrackedRun(Protocol):
    """What the trackers read of the run's state (runstate.RunState is one, and holds this package's TrackingIds):
    the trackers take it, they never import runstate."""

    tracking: TrackingIds
    progress: Progress
    history: History
    run_log: RunLog


NOT_METRICS = ("step", "epoch")


class Backend(Protocol):
    name: str

    def open(self, ids: TrackingIds, store: Any) -> bool:
        """Find or create the tracker run; True when it was created now."""

    def written(self) -> dict[str, int]:
        """The highest step stored per name (what an earlier attempt already wrote)."""

    def write(self, points: list[Point]) -> None:
        """(name, step, value, unix time the point was measured); a point sent twice is stored once."""

    def markers(self) -> set[tuple[int, int, int]]:
        """The restart markers stored, as (step, attempt, unix time in ms): ``marker_key`` of each."""

    def mark_restart(self, step: int, attempt: int, reason: str, wall_time_s: float) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_summary(self, summary: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


Point = tuple[str, int, float, float]
Marker = tuple[int, int, str, float]  # step, attempt, reason, unix time the attempt started


def restart_markers(attempts: list[dict[str, Any]]) -> list[Marker]:
    """A marker for every attempt of the run log that restarted it, numbered as the log counts attempts.

    All of them, not only this attempt's: an attempt killed before its tracker thread wrote its marker is in the
    snapshot this attempt restored, and its marker is written now (the backends skip markers they store).
    """
    markers = []
    for number, attempt in enumerate(attempts, start=1):
        # A restart before the first snapshot starts fresh: only the launcher's count tells it from a first start.
        if number > 1 or attempt["restart_count"] > 0:
            reason = "restart before the first snapshot" if attempt["reason"] == "fresh" else attempt["reason"]
            markers.append((attempt["start_step"], number, reason, attempt["started_unix"]))
    return markers


def marker_key(marker: Marker) -> tuple[int, int, int]:
    """What tells one restart from another: two attempts that resumed from the same step are two markers."""
    step, attempt, _, wall_time_s = marker
    return step, attempt, int(wall_time_s * 1000)


def metric_points(record: dict[str, Any]) -> list[tuple[str, float]]:
    return [
        (name, float(value))
        for name, value in sorted(record.items())
        if name not in NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]


class Tracking(Observer):
    """Rank 0's trackers: history records once a snapshot of their step has committed, restarts as markers.

    Every tracker call runs on the tracker's own thread (background.py): this observer only decides what
    to write and queues it, so a tracker that is slow, hung or down costs training nothing.
    """

    def __init__(self, trackers: list[TrackerThread], run: TrackedRun, config: dict[str, Any]) -> None:
        self.trackers, self.run, self.config = trackers, run, config
        # The tracker threads' own: backend -> created now (config not yet logged); -> name -> highest step stored.
        self.created: dict[str, bool] = {}
        self.written: dict[str, dict[str, int]] = {}
        self.confirmed: dict[str, int] = {}  # backend -> the step its points are written through (tracker threads)
        self.store: Any = None
        self.cursor = 0  # history records before it are queued (or skipped)

    def started(self, info: Any) -> None:
        self.store = info.store

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        # The history is the restored snapshot's now (or empty): read it from the start, skip what is stored.
        self.cursor = 0
        self.run.tracking.forget_times_after(step)
        self.run.tracking.ensure_creator(self.store)  # before the tracker thread opens the run, and the broadcast
        markers = restart_markers(self.run.run_log.attempts)
        self._each("start", lambda backend: self._start(backend, markers))

    def rolled_back(self, from_step: int, to_step: int, duration_s: float) -> None:
        # ROLLBACK (anomalies.py) put back an older history: read it from the start too, skipping what is stored.
        self.cursor = 0
        self.run.tracking.forget_times_after(to_step)

    def trained(self, interval: Any) -> None:
        self.run.tracking.measured(interval.step, time.time())

    def evaluated(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        self.run.tracking.measured(step, time.time())

    def snapshotted(self, report: SnapshotReport) -> None:
        if report.committed:
            self._write_through(report.step)
        if self.confirmed and len(self.confirmed) == len(self.trackers):
            self.run.tracking.forget_times_through(min(self.confirmed.values()))

    def transition(self, src: State, dst: State, step: int) -> None:
        if dst is State.DONE:  # the end: every record is final (and the last snapshot holds it)
            self._write_through(None)
            summary = self._summary()
            self._each("the summary", lambda backend: backend.log_summary(summary, step))

    def closed(self) -> None:
        self._each("close", lambda backend: backend.close())
        for tracker in self.trackers:
            tracker.close()

    def _start(self, backend: Backend, markers: list[Marker]) -> None:
        """On the tracker's thread, retried until it succeeds: each part done once."""
        if backend.name not in self.created:
            self.created[backend.name] = backend.open(self.run.tracking, self.store)
        if self.created[backend.name]:
            backend.log_config(self.config)
            self.created[backend.name] = False
        if backend.name not in self.written:
            self.written[backend.name] = backend.written()
        stored = backend.markers()
        for marker in markers:  # an earlier attempt killed before its thread wrote its own marker: written now
            if marker_key(marker) not in stored:
                backend.mark_restart(*marker)
                stored.add(marker_key(marker))

    def _write_through(self, step: int | None) -> None:
        records = self.run.history.records
        end = self.cursor
        while end < len(records) and (step is None or records[end]["step"] <= step):
            end += 1
        if end > self.cursor:
            batch, now = records[self.cursor : end], time.time()
            times = {record["step"]: self.run.tracking.time_of(record["step"], now) for record in batch}
            self._each("a write", lambda backend: self._write(backend, batch, times))
        self.cursor = end

    def _write(self, backend: Backend, records: list[dict[str, Any]], times: dict[int, float]) -> None:
        """On the tracker's thread: the points of ``records`` it does not store yet."""
        stored = self.written[backend.name]
        latest, points = dict(stored), []
        for record in records:
            for name, value in metric_points(record):
                if record["step"] > latest.get(name, -1):  # each (name, step) once, whatever an attempt replays
                    points.append((name, record["step"], value, times[record["step"]]))
                    latest[name] = record["step"]
        if points:
            backend.write(points)  # a failure is retried by the thread with the same points, times included
            stored.update(latest)
        self.confirmed[backend.name] = max(record["step"] for record in records)

    def _each(self, what: str, call: Callable[[Backend], None]) -> None:
        for tracker in self.trackers:
            tracker.submit(what, call)

    def _summary(self) -> dict[str, Any]:
        progress, history = self.run.progress, self.run.history
        last = {name: value for record in history.records for name, value in metric_points(record)}
        return {
            "global_step": progress.global_step,
            "epoch": progress.epoch,
            "attempts": len(self.run.run_log.attempts),
            **last,
        }


def attach_trackers(cfg: Config, events: Observers, run: TrackedRun) -> None:
    """Rank 0's trackers from ``track.*`` (none by default), each opened on its own thread (an import of seconds)."""
    track = cfg.track
    trackers: list[TrackerThread] = []
    if track.tensorboard:
        from elastictrain.observe.trackers.tensorboard_backend import TensorBoardBackend
        from elastictrain.observe.trackers.tensorboard_backend import check_installed as check_tensorboard

        check_tensorboard()
        directory = track.tensorboard_dir or f"{cfg.run_dir}/tensorboard"
        trackers.append(TrackerThread("tensorboard", lambda: TensorBoardBackend(directory)))
    if track.mlflow_uri:
        from elastictrain.observe.trackers.mlflow_backend import MlflowBackend
        from elastictrain.observe.trackers.mlflow_backend import check_installed as check_mlflow

        check_mlflow(track.mlflow_uri)
        experiment = track.mlflow_experiment or cfg.run.name
        trackers.append(TrackerThread("mlflow", lambda: MlflowBackend(track.mlflow_uri, experiment, cfg.run.name)))
    if trackers:
        events.add(Tracking(trackers, run, cfg.to_dict(redact=True)))
