"""Self-healing: a non-finite or spiking step is skipped, or rolled back and replayed to tell data from fault.

What is checked, on every rank, before each optimizer step (``session.gradients_ok()``;
``StepRunner`` calls it): the global gradient norm, where it is read, and the rank's own loss of
the step (``gradients_ok(loss=)``, or logged before it). A non-finite loss also names the rank a
NaN came from before the all-reduce spread it. Under ``skip`` each rank's finding is made every
rank's (update_check.py: a 1-element all-reduce), so every rank takes the same decision at the same
step: a fault in one rank's gradients after the all-reduce, or one rank's non-finite loss, holds
every rank's update. Under ``rollback`` a rank answers alone, with no collective: a rank that holds
its update has raised a sighting, and the vote rolls every rank back before anything leaves TRAIN
(a snapshot, an evaluation, a stop), so replicas that parted for a few steps are never kept.

``anomaly.policy``:

- ``skip``: the optimizer step is not taken on any rank (the gradients are dropped), one line
  naming the ranks that saw it, and the step's global sample indices are recorded in the
  snapshot's anomaly log. Forward passes have run: buffers they update (BatchNorm statistics)
  keep what the step's forward put there.
- ``rollback`` (the default): this rank skips the update too and raises a request the vote
  makes every rank's; at the agreed step every rank enters ROLLBACK, restores the newest
  snapshot in-process (the fast tier first) and replays bitwise. A fast copy of the step before
  the anomaly is taken during the replay. If the anomaly recurs at the same step, it is the
  data: the step's samples go on the skip list (in every snapshot, honoured by every later
  attempt and world size: the sampler leaves them out of each epoch's order) and the run rolls
  back once more, to that copy, and goes on without them — its numbers are then those of a run
  given the same list up front (``anomaly.skip_samples``). If it does not recur, it was a
  transient fault: one line naming the rank and host where that can be told, a counter, and
  the run goes on, bitwise equal to an unbroken one.

Every rollback counts against ``anomaly.max_rollbacks``; past it the run stops with one line
(an ``AnomalyError``, recorded so that restarts do not retry it), every snapshot intact.
``judge`` (what a rollback does, from every rank's sightings) is pure and table-tested.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from elastictrain.core.config import AnomalyConfig
from elastictrain.core.errors import AnomalyError
from elastictrain.dist.collectives import all_gather
from elastictrain.dist.group import DistContext
from elastictrain.dist.vote import NOTHING, Requests
from elastictrain.health.anomaly_state import AnomalyLog, GradNormStatistic, Sighting, Verdict, judge
from elastictrain.health.anomaly_text import number, of_ranks, shown_samples, stated, where
from elastictrain.health.norms import norm_of
from elastictrain.health.update_check import UpdateDecision, agree, agree_ahead, decide_update, finding_of

log = logging.getLogger("elastictrain")


class Anomalies:
    """One rank's anomaly checks and the bookkeeping of a rollback's replay. ``log``/``stats`` are in snapshots."""

    def __init__(self, cfg: AnomalyConfig, record: AnomalyLog, stats: GradNormStatistic) -> None:
        self.cfg, self.record, self.stats = cfg, record, stats
        self.active = cfg.policy != "off"
        # Whether every step's gradient norm is read (one pass over the gradients): see AnomalyConfig.
        self.check_gradients = self.active and (
            cfg.check_gradients is True
            or (cfg.check_gradients == "auto" and (cfg.policy == "skip" or cfg.spike_factor > 0))
        )
        # Whether every rank's gradients_ok answer is agreed (a collective each call): with skip alone. A skip taken by
        # some ranks only would part the replicas for good; under rollback, a rank holding its update has raised a
        # sighting (a non-finite loss or norm), and the vote rolls every rank back before anything leaves TRAIN.
        self.agreed = cfg.policy == "skip"
        self.host = socket.gethostname()
        self.pending: Sighting | None = None  # rollback mode: this rank's first anomaly since the last rollback
        self._index = 0  # which gradients_ok call of the step
        self._own_loss: tuple[int, float] | None = None  # (step, value): this rank's non-finite loss of that step
        # (step, a weak reference to the object read): a custom loop hands the same loss twice a step; weak, so the
        # last loss tensor (and what its graph holds) is not kept alive past the caller's own reference
        self._loss_read: tuple[int, weakref.ref] | None = None
        self._ahead: tuple[int, Callable[[], list]] | None = None  # (step, its agreement started before the backward)
        self._skipped_now: dict[str, Any] | None = None  # skip mode: this step's entry, samples still to add
        self._replayed_samples: list[int] | None = None  # the samples of the replayed anomalous step
        self.events: Any = None
        self.ctx: DistContext | None = None

    @property
    def replaying(self) -> int | None:
        """The anomalous step a replay is heading for (in the anomaly log: a restart mid-replay goes on with it)."""
        return self.record.replay.step if self.record.replay is not None else None

    @property
    def replay_origin(self) -> Verdict | None:
        """What the replayed step's anomaly was the first time, for the transient line."""
        return self.record.replay

    def attach(self, ctx: DistContext, events: Any) -> None:
        self.ctx, self.events = ctx, events

    @property
    def _attached(self) -> DistContext:
        assert self.ctx is not None, "attach() first"
        return self.ctx

    # -- the checks (every step) ---------------------------------------------------------------

    def gradients_ok(self, norm: float | None, step: int, loss: Any = None) -> bool:
        """Before the optimizer step of ``step`` (1-based): True to take it. With skip the same on every rank (agreed:
        a collective every rank makes); with rollback this rank's own answer (``agreed``). ``norm`` None: not read this
        step; ``loss``: this rank's loss of the step."""
        index, self._index = self._index, self._index + 1
        if step in self.record.skipped_steps:
            return False  # listed (the same list on every rank): this step's update was found to come from its data
        if not self.active:
            return True
        self.loss(loss, step)
        spike = (
            norm is not None
            and math.isfinite(norm)
            and self.stats.is_spike(index, norm, self.cfg.spike_factor, self.cfg.warmup_steps)
        )
        finding = finding_of(norm, spike, self._own_loss_of(step), self.host)
        ahead, self._ahead = self._ahead, None
        if not self.agreed:  # rollback: a rank that holds its update raised a sighting; the vote rolls every rank back
            decision = decide_update([finding])
        elif ahead is not None and ahead[0] == step and norm is None:  # every rank: the same call of the same step
            decision = decide_update(ahead[1]())
        else:
            decision = decide_update(agree(finding, self.ctx))
        if decision.take:
            if norm is not None:
                self.stats.update(index, norm, self.cfg.spike_window_steps)
            return True
        if self.cfg.policy == "skip":
            self._skip(step, decision)
        elif (
            finding is not None
            and finding.kind == "gradient norm"
            and norm is not None
            and (self.pending is None or (self.pending.step == step and self.pending.kind == "loss"))
        ):
            # Only the ranks that saw it raise it: the others hold their update, and the vote brings the rollback.
            self.pending = Sighting(step, norm, "gradient norm", self.host, spike, finding.own_loss)
        return False

    def agree_ahead(self, step: int) -> None:
        """A step runner, before the step's last backward, its losses logged and its gradients not to be read: under
        skip the agreement of ``gradients_ok`` starts now, overlapped with the backward (a collective every rank
        makes); under rollback there is none to start."""
        if self.agreed and step not in self.record.skipped_steps and self.ctx is not None and self.ctx.distributed:
            self._ahead = (step, agree_ahead(finding_of(None, False, self._own_loss_of(step), self.host), self.ctx))

    def _own_loss_of(self, step: int) -> float | None:
        return self._own_loss[1] if self._own_loss is not None and self._own_loss[0] == step else None

    def loss(self, value: Any, step: int) -> None:
        """A rank's own loss of ``step`` (None: not logged): a non-finite one holds the step's update (every rank's,
        agreed in ``gradients_ok``) and, in rollback mode, is raised for the vote."""
        if value is None or not self.active or step in self.record.skipped_steps:
            return
        read = self._loss_read
        if read is not None and read[0] == step and read[1]() is value:  # gradients_ok(loss=) then step(loss=): read
            return
        try:
            self._loss_read = (step, weakref.ref(value))
        except TypeError:  # a float or an int: reading it again costs nothing
            self._loss_read = None
        # a tensor's one element (a host read on an accelerator; detached: no warning for one that requires grad)
        number = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if math.isfinite(number):
            return
        if self._own_loss is None or self._own_loss[0] != step:
            self._own_loss = (step, number)
        if self.cfg.policy != "rollback":
            return
        if self.pending is None:
            self.pending = Sighting(step, number, "loss", self.host, own_loss=True)
        elif self.pending.step == step:
            self.pending = dataclasses.replace(self.pending, own_loss=True)

    def weights(self, parameters: Iterable[torch.Tensor], step: int) -> None:
        """Before anything leaves TRAIN (a snapshot, above all): this rank's weights must be finite, or the update
        that broke them (an anomaly the cheaper checks let through) is rolled back instead of saved."""
        if self.cfg.policy != "rollback" or self.pending is not None:
            return
        # FSDP: this rank's shards alone, no collective (ranks with a sighting skip this check): every element is
        # checked by the rank holding it, and the sightings of all ranks are gathered at the vote.
        local = [
            p.detach().to_local() if isinstance(p, DTensor) else p.detach()  # type: ignore[attr-defined]
            for p in parameters
        ]  # (a DTensor's detach() is a DTensor: torch's stub says Tensor)
        if not math.isfinite(norm_of(local)):
            self.pending = Sighting(step, math.nan, "weights", self.host)

    def stepped(self, step: int, samples: Callable[[], list[int] | None]) -> None:
        """``session.step()`` of ``step``, before the data position moves on: the step's samples where wanted."""
        self._index = 0
        if self._skipped_now is not None:
            entry, self._skipped_now = self._skipped_now, None
            entry["samples"] = samples() or []
            self.record.add(**entry)
            self._say_skip(entry)
        if self.replaying == step:
            self._replayed_samples = samples()

    def _skip(self, step: int, decision: UpdateDecision) -> None:
        if self._skipped_now is None:  # the first check of the step that failed names it
            found = decision.found
            assert found is not None  # an update not taken names what was found
            self._skipped_now = {
                "step": step,
                "value": found.value,
                "kind": found.kind,
                "spike": found.spike,
                "decision": "skip",
                "ranks": list(decision.ranks),
                "hosts": list(decision.hosts),
                "origin": list(decision.origin),
            }

    def _say_skip(self, entry: dict[str, Any]) -> None:
        if self.ctx is not None and self.ctx.is_main:
            hosts = dict(zip(entry["ranks"], entry["hosts"]))
            seen = where(
                entry["kind"],
                entry["ranks"],
                entry["origin"],
                [hosts.get(r) for r in range(self.ctx.world_size)],
                self.ctx.world_size,
            )
            log.warning(
                "anomaly at step %d: %s%s; the optimizer step was skipped on every rank (anomaly.policy=skip), "
                "its %d samples recorded (%s)",
                entry["step"],
                stated(entry["kind"], entry["value"], entry["spike"], self.cfg),
                seen,
                len(entry["samples"]),
                shown_samples(entry["samples"]),
            )
        self._emit(entry)

    # -- the vote and the replay ----------------------------------------------------------------

    def due(self, step: int, fast_tier: bool) -> Requests:
        """Every rank at the same step of a replay: a copy of the step before the anomaly, to roll back to should
        it recur (so that the run then goes on from there without its samples)."""
        if self.replaying is not None and step == self.replaying - 1:
            return Requests(local_snapshot=True) if fast_tier else Requests(snapshot=True)
        return NOTHING

    def verifying(self, step: int) -> bool:
        """The replay reached the anomalous step: every rank settles the vote here to learn whether it recurred."""
        return self.replaying is not None and step == self.replaying

    def replayed_clean(self, step: int) -> None:
        """The replay passed the anomalous step with no anomaly on any rank: a transient fault."""
        seen = self.replay_origin
        self.record.replay = None
        assert seen is not None  # replaying: the verdict being replayed
        entry = {
            "step": step,
            "value": seen.value,
            "kind": seen.kind,
            "decision": "transient",
            "ranks": list(seen.ranks),
            "hosts": self._hosts(seen.ranks),
        }
        self.record.add(**entry)
        if self._attached.is_main:
            log.warning(
                "step %d replayed clean: the anomaly (%s %s) was a transient fault%s; training goes on "
                "(transient faults so far: %d)",
                step,
                seen.kind,
                number(seen.value),
                self._where(seen),
                self.record.counts["transient"],
            )
        self._emit(entry)

    def agree(self) -> Verdict:
        """ROLLBACK, on every rank: gather what each rank saw and judge it; say it in one line; stop past the budget."""
        sightings = all_gather(self.pending, self._attached) if self._attached.distributed else [self.pending]
        self._hosts_by_rank = [s.host if s is not None else None for s in sightings]
        verdict = judge(sightings, self.replaying, self.record.rollbacks, self.cfg.max_rollbacks)
        what = f"{verdict.kind} {number(verdict.value)}" + (
            " (a spike)" if any(s is not None and s.spike for s in sightings) else ""
        )
        if verdict.action == "fault":
            raise AnomalyError(
                f"anomaly at step {verdict.step} ({what}{self._where(verdict)}) recurred on replay in those ranks' "
                "gradients only, which the all-reduce makes equal on every rank: a persistent hardware fault there, "
                "not the data; training stopped, every snapshot is intact; replace that node (or exclude it) and "
                "launch again"
            )
        if verdict.action == "stop":
            raise AnomalyError(
                f"anomaly at step {verdict.step} ({what}{self._where(verdict)}) after {self.record.rollbacks} "
                f"rollback(s), anomaly.max_rollbacks={self.cfg.max_rollbacks}: training stopped, every snapshot is "
                "intact; look at the anomaly log (elastictrain snapshots show), then raise anomaly.max_rollbacks, "
                "set anomaly.policy=skip, or fix the data or the learning rate"
            )
        return verdict

    def nothing_to_roll_back_to(self, verdict: Verdict) -> AnomalyError:
        """ROLLBACK found no snapshot (an anomaly before the first one): the one line to stop with."""
        return AnomalyError(
            f"anomaly at step {verdict.step} ({verdict.kind} {number(verdict.value)}) and no snapshot "
            "to roll back to yet: training stopped; take snapshots more often "
            "(snapshot.durable.every_steps, or a fast tier: snapshot.local.url with "
            "snapshot.local.every_steps), or set anomaly.policy=skip"
        )

    def rolled_back(self, verdict: Verdict, samples: list[int] | None, restored_step: int, rank_batch: int = 0) -> None:
        """After the restore: what this rollback learned, in the log, and the replay to watch. ``samples``: the
        replayed step's global samples (a data verdict); ``rank_batch``: each rank's share of a micro-batch."""
        self.pending, self._skipped_now, self._replayed_samples, self._own_loss = None, None, None, None
        self._ahead = None
        self._index = 0
        entry = {
            "step": verdict.step,
            "value": verdict.value,
            "kind": verdict.kind,
            "decision": verdict.action,
            "ranks": list(verdict.ranks),
            "hosts": self._hosts(verdict.ranks),
            "rolled_back_to": restored_step,
            "origin": list(verdict.origin),
        }
        if verdict.action == "data":
            self.record.replay = None
            if samples is not None:
                samples = of_ranks(samples, verdict.origin, self._attached.world_size, rank_batch)
                self.record.skipped_samples.update(samples)
                entry["samples"] = list(samples)
            else:
                self.record.skipped_steps.add(verdict.step)
            self.record.add(**entry)
            if self._attached.is_main:
                log.warning(
                    "anomaly at step %d recurred on replay (%s %s): it is the data; %s skipped from now on "
                    "at every world size; rolled back to step %d (rollback %d of %d)",
                    verdict.step,
                    verdict.kind,
                    number(verdict.value),
                    f"its {len(samples)} samples ({shown_samples(samples)}) are"
                    if samples is not None
                    else "the step's update is",
                    restored_step,
                    self.record.rollbacks,
                    self.cfg.max_rollbacks,
                )
        else:
            self.record.replay = verdict
            self.record.add(**entry)
            if self._attached.is_main:
                log.warning(
                    "anomaly at step %d: %s %s%s; rolled back to step %d to replay it (rollback %d of %d)",
                    verdict.step,
                    verdict.kind,
                    number(verdict.value),
                    self._where(verdict),
                    restored_step,
                    self.record.rollbacks,
                    self.cfg.max_rollbacks,
                )
        self._emit(entry)

    @property
    def replayed_samples(self) -> list[int] | None:
        return self._replayed_samples

    # -- helpers ------------------------------------------------------------------------------

    def _hosts(self, ranks: Iterable[int]) -> list[str]:
        hosts = getattr(self, "_hosts_by_rank", None) or []
        return [hosts[r] for r in ranks if r < len(hosts) and hosts[r] is not None]

    def _where(self, verdict: Verdict) -> str:
        world = self.ctx.world_size if self.ctx is not None else 1
        return where(verdict.kind, verdict.ranks, verdict.origin, getattr(self, "_hosts_by_rank", None) or [], world)

    def _emit(self, entry: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.anomaly(dict(entry))


__all__ = [
    "AnomalyLog",
    "Anomalies",
    "GradNormStatistic",
    "Sighting",
    "Verdict",
    "judge",
]
