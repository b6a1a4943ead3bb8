"""The observer that feeds trackers the run's history, each (name, step) once, and the tracker run id it keeps."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Protocol

from ..config import REDACTED, Config
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
    """Rank 0's trackers: history records once a snapshot of their step has committed, restarts as markers."""

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
        attempts = self.run.run_log.attempts
        for backend in self.backends:
            if backend.name not in self.written:
                created = backend.open(self.run.tracking, self.store)
                if created:
                    backend.log_config(self.config)
                self.written[backend.name] = backend.written()
            if len(attempts) > 1:
                backend.mark_restart(step, len(attempts), attempts[-1].get("reason", "restart"))

    def snapshotted(self, report: SnapshotReport) -> None:
        if report.committed:
            self._write_through(report.step)

    def transition(self, src: State, dst: State, step: int) -> None:
        if dst is State.DONE:  # the end: every record is final (and the last snapshot holds it)
            self._write_through(None)
            summary = self._summary()
            for backend in self.backends:
                backend.log_summary(summary, step)

    def closed(self) -> None:
        for backend in self.backends:
            backend.close()

    def _write_through(self, step: int | None) -> None:
        records = self.run.history.records
        end = self.cursor
        while end < len(records) and (step is None or records[end]["step"] <= step):
            end += 1
        for backend in self.backends:
            stored = self.written[backend.name]
            points = []
            for record in records[self.cursor:end]:
                for name, value in metric_points(record):
                    if record["step"] > stored.get(name, -1):
                        points.append((name, record["step"], value))
                        stored[name] = record["step"]
            if points:
                backend.write(points)
        self.cursor = end

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
        config = cfg.to_dict(redact=True)
        config["track"]["mlflow_uri"] = re.sub(r"//[^/@]*@", f"//{REDACTED}@", track.mlflow_uri)  # user:password@host
        events.add(Tracking(backends, run, config))
