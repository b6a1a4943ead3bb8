"""The run's own state, one ``Stateful`` bundle: where training is, what it measured, how it ran.

Every snapshot holds these beside the user's registered state, under their own names:
``progress`` (step, epoch, data position), ``history`` (reduced metrics), ``run_log`` (one
record per attempt), ``goodput`` (its counters), ``batch_geometry`` (the global batch the
elastic policy kept), ``threads`` (the intra-op thread count every start pins), ``anomalies``
(the skip lists and every anomaly's decision), ``grad_norms`` (the running gradient norms
spikes are judged against) and ``tracking`` (the tracker run ids). A rollback restores all but
``ROLLBACK_KEEPS``: what the process measured and what the rollback learned.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from elastictrain.core.progress import History, Progress, RunLog
from elastictrain.core.threads import ThreadPin
from elastictrain.data.geometry import BatchGeometry
from elastictrain.health.anomaly_state import AnomalyLog, GradNormStatistic
from elastictrain.observe.goodput import Goodput
from elastictrain.observe.trackers.ids import TrackingIds

RESERVED_NAMES = (
    "progress",
    "history",
    "run_log",
    "goodput",
    "batch_geometry",
    "threads",
    "anomalies",
    "grad_norms",
    "tracking",
)
ROLLBACK_KEEPS = ("run_log", "goodput", "threads", "anomalies", "tracking")


class RunState:
    def __init__(self, intra_op_threads: int | Literal["auto", "off"], skip_samples: Iterable[int] = ()) -> None:
        self.progress = Progress()
        self.history = History()
        self.run_log = RunLog()
        self.goodput = Goodput()  # on every rank: its counters travel in the snapshot
        self.batch_geometry = BatchGeometry()
        self.threads = ThreadPin(intra_op_threads)  # bits: the run's thread count at every start
        self.anomalies = AnomalyLog(skip_samples)
        self.grad_norms = GradNormStatistic()
        self.tracking = TrackingIds()  # one tracker run across attempts (trackers/)

    def statefuls(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RESERVED_NAMES}

    def record_train_means(self, means: dict[str, float], lr: float | None) -> dict[str, float]:
        """The history record of the training metrics reduced at this step (a log interval, or a survivor copy's)."""
        record = {f"train_{name}": value for name, value in means.items()}
        if lr is not None:
            record["lr"] = lr
        self.history.append(step=self.progress.global_step, epoch=self.progress.epoch, **record)
        return record
