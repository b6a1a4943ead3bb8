"""What tracking keeps in the run's snapshots (a Stateful of ``RunState``): the tracker run ids, and the wall time of
each history record the trackers may not have stored yet."""

from __future__ import annotations

import uuid
from typing import Any

RUN_ID_KEY = "tracking/mlflow_run_id"  # in the launcher's store: for an attempt that died before its first snapshot
CREATOR_KEY = (
    "tracking/creator"  # in the launcher's store: the creator token of an attempt that died before its first snapshot
)


class TrackingIds:
    """The tracker run ids of this elastictrain run (MLflow's), saved in every snapshot: one tracker run across
    attempts and relaunches. And when each record not yet stored by every tracker was measured: a point carries its
    own time, the same in every attempt that writes it (so a write sent twice is stored once)."""

    def __init__(self) -> None:
        self.mlflow_run_id = ""
        # Tags the tracker run when it is created, and is looked for before any create: an attempt that made the run
        # but died (or timed out) before it kept the id does not make a second one. In every rank's snapshots from the
        # start, where the id only comes once rank 0's tracker thread has opened the run.
        self.creator = ""
        self.times: dict[int, float] = {}  # step -> unix time its record was measured
        self.shared = False  # every rank holds rank 0's run id (equal on all ranks: set from a broadcast's result)

    def ensure_creator(self, store: Any) -> None:
        """Rank 0 at each start, before its tracker thread opens the run."""
        if self.creator:
            return
        if store is not None and store.check([CREATOR_KEY]):
            self.creator = store.get(CREATOR_KEY).decode()
            return
        self.creator = uuid.uuid4().hex
        if store is not None:
            store.set(CREATOR_KEY, self.creator)

    def measured(self, step: int, wall_time_s: float) -> None:
        self.times.setdefault(step, wall_time_s)  # an evaluation at a log step keeps the step's first time

    def time_of(self, step: int, default: float) -> float:
        return self.times.get(step, default)

    def forget_times_after(self, step: int) -> None:
        """A restore or rollback to ``step``: later records will be measured again."""
        self.times = {s: t for s, t in self.times.items() if s <= step}

    def forget_times_through(self, step: int) -> None:
        """Every tracker stores the points up to ``step``."""
        self.times = {s: t for s, t in self.times.items() if s > step}

    def state_dict(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.mlflow_run_id, "creator": self.creator, "times": sorted(self.times.items())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mlflow_run_id = state_dict.get("mlflow_run_id", "") or self.mlflow_run_id
        self.creator = state_dict.get("creator", "") or self.creator
        self.times = {int(step): float(t) for step, t in state_dict.get("times", [])}


def share_run_id(ids: TrackingIds, ctx: Any, at_start: bool = False) -> None:
    """Give every rank's snapshots rank 0's tracker run id and creator token (a fast copy from any node resumes the
    same tracker run).

    Called on every rank at the start (always) and at each snapshot until one broadcast carried a run id: rank 0's
    tracker thread opens the run in the background, so the first broadcasts may carry none.
    """
    if ids.shared and not at_start:
        return
    from elastictrain.dist.collectives import broadcast_from_main

    run_id, creator = broadcast_from_main((ids.mlflow_run_id, ids.creator), ctx)
    if not ctx.is_main:  # rank 0's own id may have arrived from its tracker thread meanwhile
        ids.mlflow_run_id, ids.creator = run_id, creator
    ids.shared = bool(run_id)
