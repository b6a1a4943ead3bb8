"""Whether a step's update is taken: under ``anomaly.policy=skip`` one answer on every rank, agreed, never assumed.

Before an optimizer step each rank looks at its own numbers: the gradient norm it read and its own
loss of the step. After the gradient all-reduce the norms are equal on every rank — unless a rank's
memory or device changed its gradients afterwards — and the losses are each rank's own, so each
rank alone can come to a different answer. A skip taken by some ranks only leaves replicas that
differ and a run that exits 0 with a wrong model. So each rank's ``Finding`` (``finding_of``, pure)
is made every rank's (``agree``: one 1-element all-reduce, MAX of "this rank found something"; the
findings themselves are gathered only when one was found) and ``decide_update`` (pure,
table-tested) turns the same list into the same decision on every rank. Under rollback a rank decides from its
own finding alone (``decide_update([finding])``, anomalies.py): a rank that holds its update raises a sighting,
and the vote rolls every rank back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from elastictrain.dist.collectives import all_gather, any_rank, any_rank_start
from elastictrain.dist.group import DistContext

# What a decision reports first when ranks saw different things: the norm of the all-reduced gradients is
# every rank's concern; a loss is one rank's.
KINDS = ("gradient norm", "loss")


@dataclass(frozen=True)
class Finding:
    """What one rank's check found wrong before an update: a non-finite or spiking gradient norm, or its own
    non-finite loss of the step."""

    kind: str  # "gradient norm" or "loss"
    value: float
    spike: bool = False  # a finite norm over anomaly.spike_factor times its running mean
    own_loss: bool = False  # this rank's own loss of the step was non-finite (where a NaN started)
    host: str = ""


@dataclass(frozen=True)
class UpdateDecision:
    """The update is taken, or not; when not, what was found (reported first) and by which ranks."""

    take: bool
    ranks: tuple[int, ...] = ()  # the ranks that found something
    found: Finding | None = None
    hosts: tuple[str, ...] = ()  # theirs, in the same order
    origin: tuple[int, ...] = ()  # the ranks whose own loss was non-finite


TAKE = UpdateDecision(True)  # nothing found: the decision of almost every step, made once


def finding_of(norm: float | None, spike: bool, loss: float | None, host: str = "") -> Finding | None:
    """This rank's finding from the gradient norm it read (None: not read), whether that norm spikes, and its own
    loss of the step (None: not known); None when nothing is wrong."""
    own_loss = loss is not None and not math.isfinite(loss)
    if norm is not None and (not math.isfinite(norm) or spike):
        return Finding("gradient norm", norm, spike, own_loss, host)
    if own_loss and loss is not None:
        return Finding("loss", loss, own_loss=True, host=host)
    return None


def decide_update(findings: list[Finding | None]) -> UpdateDecision:
    """From every rank's finding (in rank order): the update is taken only when no rank found anything."""
    seen = [(rank, f) for rank, f in enumerate(findings) if f is not None]
    if not seen:
        return TAKE
    found = min((f for _, f in seen), key=lambda f: KINDS.index(f.kind))
    return UpdateDecision(
        False,
        tuple(rank for rank, _ in seen),
        found,
        tuple(f.host for _, f in seen),
        tuple(rank for rank, f in seen if f.own_loss),
    )


def agree(finding: Finding | None, ctx: DistContext | None) -> list[Finding | None]:
    """Every rank's finding, in rank order, on every rank. One 1-element all-reduce a call; the findings are
    gathered (a second collective) only when some rank has one."""
    if ctx is None or not ctx.distributed:
        return [finding]
    if not any_rank(finding is not None, ctx):
        return [None] * ctx.world_size
    return all_gather(finding, ctx)


def agree_ahead(finding: Finding | None, ctx: DistContext | None) -> Callable[[], list[Finding | None]]:
    """``agree`` with its all-reduce started now (overlapped with a backward, when this rank's finding is known
    before it: its own loss); the returned function waits for it and gives every rank's finding."""
    if ctx is None or not ctx.distributed:
        return lambda: [finding]
    anyone = any_rank_start(finding is not None, ctx)
    return lambda: all_gather(finding, ctx) if anyone() else [None] * ctx.world_size


__all__ = ["Finding", "UpdateDecision", "agree", "agree_ahead", "decide_update", "finding_of"]
