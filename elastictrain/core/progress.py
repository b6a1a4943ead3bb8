"""Where a run is and what it has done: the progress counters, the metric history, one record per attempt.

Each is a small stateful record every snapshot carries (snapshot/format.py) and every layer may read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Progress:
    """Where training is. ``epoch_offset`` counts global samples, so it re-shards over any world size."""

    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed (the current epoch's index)
    epoch_offset: int = 0  # global samples consumed in the current epoch
    samples_seen: int = 0  # global samples consumed in all epochs
    last_evaluated_step: int = -1
    last_snapshot_step: int = -1
    last_local_snapshot_step: int = -1  # the fast tier's

    def advance(self, samples: int) -> None:
        self.global_step += 1
        self.epoch_offset += samples
        self.samples_seen += samples

    def end_epoch(self) -> None:
        self.epoch += 1
        self.epoch_offset = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state_dict[f.name]))


@dataclass
class History:
    """Reduced metrics over time: one record per log interval or evaluation, identical on every rank."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def append(self, **record: Any) -> None:
        self.records.append(record)

    def last(self, key: str) -> Any:
        for record in reversed(self.records):
            if key in record:
                return record[key]
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(r) for r in self.records]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state_dict["records"]]


@dataclass
class RunLog:
    """One record per attempt (launch or restart) of this run, so run-level figures survive relaunches."""

    attempts: list[dict[str, Any]] = field(default_factory=list)

    def begin(
        self,
        *,
        restart_count: int,
        world_size: int,
        start_step: int,
        launcher: str,
        started_unix: float,
        restored: bool,
    ) -> dict[str, Any]:
        if not restored:
            reason = "fresh"
        elif restart_count > 0:
            reason = "restart"  # the launcher restarted the workers after a failure
        else:
            reason = "relaunch"  # a new launch (after preemption, a lost node, or by hand) resumed
        attempt = {
            "restart_count": restart_count,
            "world_size": world_size,
            "start_step": start_step,
            "started_unix": started_unix,
            "launcher": launcher,
            "reason": reason,
            "preempted": 0,
            "wall_s": 0.0,
        }
        self.attempts.append(attempt)
        return attempt

    @property
    def current(self) -> dict[str, Any]:
        return self.attempts[-1]

    def total(self, key: str) -> float:
        return sum(attempt.get(key, 0) for attempt in self.attempts)

    def state_dict(self) -> dict[str, Any]:
        return {"attempts": [dict(a) for a in self.attempts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.attempts = [dict(a) for a in state_dict["attempts"]]
