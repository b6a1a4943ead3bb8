"""What self-healing remembers and decides between steps: the ranks' sightings and the rollback verdict (``judge``,
pure), the running gradient-norm statistic, and the anomaly log every snapshot carries (anomalies.py uses them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sighting:
    """What one rank saw: the first anomalous step since the last rollback, the value, and where."""

    step: int
    value: float
    kind: str  # "gradient norm", "loss" (a rank's own), or "weights" (non-finite before a snapshot)
    host: str
    spike: bool = False  # a finite value over anomaly.spike_factor times its running mean
    own_loss: bool = False  # this rank's own loss was non-finite at that step: a NaN started here


@dataclass(frozen=True)
class Verdict:
    """What a ROLLBACK does: ``rollback`` (replay to tell data from fault), ``data`` (it recurred: skip the
    step's samples), ``fault`` (it recurred in some ranks' gradients only: their hardware) or ``stop`` (over
    the budget)."""

    action: str
    step: int
    ranks: tuple[int, ...]
    value: float
    kind: str
    origin: tuple[int, ...] = ()  # the ranks whose own loss was non-finite at that step: where a NaN came from


def judge(sightings: list[Sighting | None], replaying: int | None, rollbacks: int, budget: int) -> Verdict:
    """From every rank's sighting (None: saw nothing), the step being replayed (None: no replay) and the
    rollbacks so far: what this rollback does. The same on every rank (the sightings are gathered)."""
    seen = [(rank, s) for rank, s in enumerate(sightings) if s is not None]
    if not seen:
        raise RuntimeError("ROLLBACK without an anomaly on any rank")  # decide() only enters it on one
    step = min(s.step for _, s in seen)
    at_step = [(rank, s) for rank, s in seen if s.step == step]
    ranks = tuple(rank for rank, _ in at_step)
    first = min((s for _, s in at_step), key=lambda s: ("gradient norm", "loss", "weights").index(s.kind))
    origin = tuple(rank for rank, s in at_step if s.own_loss)
    if rollbacks >= budget:
        action = "stop"
    elif replaying == step and len(ranks) < len(sightings) and not origin:
        # Data reaches every rank through the all-reduce, or starts as a rank's non-finite loss: an anomaly
        # in some ranks' gradients only, again on replay, is that hardware's (a rank's memory or device).
        action = "fault"
    elif replaying == step:
        action = "data"
    else:
        action = "rollback"
    return Verdict(action, step, ranks, first.value, first.kind, origin)


class GradNormStatistic:
    """The running mean of each check's gradient norm (one per ``gradients_ok`` call in a step): training
    state, in every snapshot and restored by a rollback, so a resumed run judges spikes as an unbroken one."""

    def __init__(self) -> None:
        self.means: list[float] = []
        self.counts: list[int] = []

    def is_spike(self, index: int, norm: float, factor: float, warmup_steps: int) -> bool:
        if factor <= 0 or index >= len(self.means) or self.counts[index] < warmup_steps:
            return False
        return norm > factor * self.means[index]

    def update(self, index: int, norm: float, window: int) -> None:
        while len(self.means) <= index:
            self.means.append(0.0)
            self.counts.append(0)
        count = self.counts[index] + 1
        weight = 1.0 / min(count, window)  # the plain mean while warming up, then an exponential one
        self.means[index] += weight * (norm - self.means[index])
        self.counts[index] = count

    def state_dict(self) -> dict[str, Any]:
        return {"means": list(self.means), "counts": list(self.counts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.means = [float(m) for m in state_dict.get("means", [])]
        self.counts = [int(c) for c in state_dict.get("counts", [])]


class AnomalyLog:
    """What the run learned: the skip lists, every anomaly and its decision, the counters. In every snapshot;
    a rollback keeps it (it is what the rollback found out), a restart restores it."""

    def __init__(self, skip_samples: Iterable[int] = ()) -> None:
        self.preset = frozenset(int(i) for i in skip_samples)  # anomaly.skip_samples: given, not learned
        self.skipped_samples: set[int] = set(self.preset)  # global sample indices the sampler leaves out
        self.skipped_steps: set[int] = set()  # steps whose update is not taken (a loop without map-style data)
        self.entries: list[dict[str, Any]] = []
        self.counts = {"skip": 0, "rollback": 0, "data": 0, "transient": 0}
        # A rollback's replay under way: its verdict, until the replay passes the step (transient) or it recurs. Saved,
        # so that an attempt restarted in the middle of a replay still concludes it (a preemption, a lost peer).
        self.replay: Verdict | None = None

    def add(self, **entry: Any) -> None:
        self.entries.append(entry)
        self.counts[entry["decision"]] = self.counts.get(entry["decision"], 0) + 1

    @property
    def rollbacks(self) -> int:
        return self.counts["rollback"] + self.counts["data"]

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_samples": sorted(self.skipped_samples - self.preset),
            "skipped_steps": sorted(self.skipped_steps),
            "entries": [dict(e) for e in self.entries],
            "counts": dict(self.counts),
            "replay": None if self.replay is None else _verdict_state(self.replay),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_samples.clear()  # in place: the training data holds this very set
        self.skipped_samples.update(self.preset, (int(i) for i in state_dict.get("skipped_samples", [])))
        self.skipped_steps = {int(s) for s in state_dict.get("skipped_steps", [])}
        self.entries = [dict(e) for e in state_dict.get("entries", [])]
        self.counts = {**self.counts, **{k: int(v) for k, v in state_dict.get("counts", {}).items()}}
        replay = state_dict.get("replay")
        self.replay = None if replay is None else _verdict_from(replay)


def _verdict_state(verdict: Verdict) -> dict[str, Any]:
    return {**vars(verdict), "ranks": list(verdict.ranks), "origin": list(verdict.origin)}


def _verdict_from(state: dict[str, Any]) -> Verdict:
    return Verdict(
        action=str(state["action"]),
        step=int(state["step"]),
        ranks=tuple(int(r) for r in state["ranks"]),
        value=float(state["value"]),
        kind=str(state["kind"]),
        origin=tuple(int(r) for r in state["origin"]),
    )
