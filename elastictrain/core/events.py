"""What the loop reports as it runs, for observers (metrics, goodput, plots, JSON logs) to consume.

The loop computes these numbers anyway; it hands them to every registered ``Observer`` at the
places they already exist, so an observer adds no collective and no change to the loop's shape.
Every rank gets every event (rank-0-only work is the observer's own ``if``); events carry plain
numbers, never the loop itself, so observers import nothing of ``loop``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from elastictrain.core.states import State

log = logging.getLogger("elastictrain")


@dataclass(frozen=True)
class RunInfo:
    """Who this worker is, known once SETUP has read the launch environment."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int  # GROUP_RANK under torchrun, SLURM_NODEID under srun, else 0
    restart_count: int  # from the launcher (TORCHELASTIC_RESTART_COUNT / SLURM_RESTART_COUNT)
    launcher: str
    run_dir: str
    total_steps: int  # optimizer steps in the whole run at this world size
    # The launcher's key-value store (torchrun's agent store, namespaced to this run), which
    # outlives worker restarts; None without torchrun. For small run-wide facts such as the
    # highest step any attempt reached: one set() per log interval at most.
    store: Any = None
    round_id: str = ""  # the rendezvous round's nonce, the same on all its ranks (keys of this round only)

    @classmethod
    def of(cls, ctx: Any, run_dir: str, total_steps: int) -> RunInfo:
        """From a ``dist.DistContext`` (typed loosely: events imports nothing of the package's)."""
        env = ctx.env
        return cls(
            rank=ctx.rank,
            local_rank=env.local_rank,
            world_size=ctx.world_size,
            node_rank=env.node_rank,
            restart_count=env.restart_count,
            launcher=env.launcher,
            run_dir=run_dir,
            total_steps=total_steps,
            store=ctx.run_store,
            round_id=ctx.round_id,
        )


@dataclass(frozen=True)
class TrainInterval:
    """One log interval of training, reduced over all ranks (identical on every rank)."""

    step: int  # global step at the end of the interval
    epoch: int
    steps: int  # optimizer steps in the interval
    samples: int  # global samples in the interval
    elapsed_s: float  # wall time of the interval on this rank
    metrics: dict[str, float]  # train_loss, train_<metric>, lr
    step_time_s_by_rank: list[float] = field(default_factory=list)  # mean step time of each rank
    sync_wait_s_by_rank: list[float] = field(
        default_factory=list
    )  # each rank's mean wait per step in the gradient all-reduce


class Tier(str, Enum):
    """Which snapshot tier a report is of; a str, so ``Tier.LOCAL == "local"`` and it prints and serialises as one."""

    DURABLE = "durable"  # snapshot.durable: the run's record, written by rank 0
    LOCAL = "local"  # snapshot.local: a node's fast copy, reported on each node's writer

    def __str__(self) -> str:
        return self.value


class Committed(NamedTuple):
    """The newest committed snapshot a tier knows of."""

    step: int
    unix: float  # when it was committed (time.time())


@dataclass(frozen=True)
class SnapshotReport:
    """One snapshot of either tier, committed or failed, as observers are told of it (``Observer.snapshotted``)."""

    step: int
    committed: bool
    duration_s: float  # training blocked by this snapshot
    size_bytes: int = 0
    error: str | None = None  # one line, when not committed
    write_s: float = 0.0  # an asynchronous snapshot's write in the background (0: written while training waited)
    tier: Tier = Tier.DURABLE

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", Tier(self.tier))  # an observer's test may say tier="local"


class Observer:
    """Base class with a no-op for every event; override the ones you need."""

    def started(self, info: RunInfo) -> None:
        """SETUP is done: who this worker is, the world size and the run's steps (``RunInfo``)."""

    def transition(self, src: State, dst: State, step: int) -> None:
        """The worker went from ``src`` to ``dst`` at ``step``."""

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        """RESTORE finished at ``step`` in ``duration_s``; ``from_snapshot`` is False on a fresh start."""

    def trained(self, interval: TrainInterval) -> None:
        """A logging interval's metrics, reduced across ranks (every ``train.log_every_steps``)."""

    def evaluated(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        """EVALUATE's metrics at ``step``, already reduced across ranks."""

    def snapshotted(self, report: SnapshotReport) -> None:
        """A snapshot of either tier was committed, or failed (``report.error``)."""

    def preempt_requested(self, signal_name: str, step: int) -> None:
        """``signal_name`` reached this rank at ``step``; every rank stops at the next agreed step."""

    def rolled_back(self, from_step: int, to_step: int, duration_s: float) -> None:
        """ROLLBACK restored step ``to_step`` in this process; training had reached ``from_step``."""

    def anomaly(self, entry: dict[str, Any]) -> None:
        """An anomaly's decision (anomalies.py): step, ranks, hosts, value, kind, decision (skip, rollback, data,
        transient), samples skipped; the same entry as the snapshot's anomaly log."""

    def closed(self) -> None:
        """The worker is leaving (any terminal state): stop servers, flush files."""


class Observers(Observer):
    """Fan one event out to many observers; an observer that raises is logged once and dropped.

    Observation must never stop training: a broken exporter loses its metrics, not the run.
    """

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self.observers = list(observers)

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)

    def _emit(self, event: str, *args: Any) -> None:
        for observer in list(self.observers):
            try:
                getattr(observer, event)(*args)
            except Exception:
                log.exception("observer %s failed in %s and is switched off", type(observer).__name__, event)
                self.observers.remove(observer)

    def started(self, info: RunInfo) -> None:
        self._emit("started", info)

    def transition(self, src: State, dst: State, step: int) -> None:
        self._emit("transition", src, dst, step)

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        self._emit("restored", step, duration_s, from_snapshot)

    def rolled_back(self, from_step: int, to_step: int, duration_s: float) -> None:
        self._emit("rolled_back", from_step, to_step, duration_s)

    def anomaly(self, entry: dict[str, Any]) -> None:
        self._emit("anomaly", entry)

    def trained(self, interval: TrainInterval) -> None:
        self._emit("trained", interval)

    def evaluated(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        self._emit("evaluated", step, epoch, metrics)

    def snapshotted(self, report: SnapshotReport) -> None:
        self._emit("snapshotted", report)

    def preempt_requested(self, signal_name: str, step: int) -> None:
        self._emit("preempt_requested", signal_name, step)

    def closed(self) -> None:
        self._emit("closed")
