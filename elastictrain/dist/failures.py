"""Why a rank stopped, said once in one line: a traceback only for bugs.

An elastictrain error (bad input, a store that is gone) is one line, said once on the node
(fatal.py), and recorded for the restarts when no restart can help; a signal during SETUP ends the
rank quietly; a collective that failed because a peer went away becomes ``PeerLost``, which the
launcher's restart answers. The line is logged, and the exception marked, so neither the uncaught
exception's hook nor the command line prints it again. Anything else is a bug: its traceback is
logged, once (marked likewise), unless an earlier attempt
crashed the same way at the same step: then it is ``RepeatedCrash``, one line, and no restart
follows (repeats.py).
"""

from __future__ import annotations

import logging
import re

import torch

from elastictrain.core.errors import (
    ElastictrainError,
    PeerLost,
    RepeatedCrash,
    RepeatedFatalError,
    UsageError,
    mark_logged,
    one_line,
)
from elastictrain.core.events import Committed
from elastictrain.core.fatal import claim_line
from elastictrain.core.repeats import record_crash
from elastictrain.core.signals import SignalledInSetup, requeue_slurm_job
from elastictrain.dist import group as dist

log = logging.getLogger("elastictrain")


def report_failure(
    exc: BaseException, rank: str, state: str, step: int, ctx: dist.DistContext | None, requeue: bool
) -> ElastictrainError | None:
    """Log why this rank stopped; what to raise instead of ``exc``: ``PeerLost`` when a peer was lost,
    ``RepeatedCrash`` when an earlier attempt crashed the same way."""
    if isinstance(exc, SignalledInSetup):  # no traceback: the launcher (or the user) asked it to stop
        log.error("%s", exc.line(rank))
        if requeue and rank == "0":
            requeue_slurm_job()
    elif isinstance(exc, RepeatedFatalError):
        if claim_line(exc):  # under torchrun: said once on this node (fatal.py)
            _log_error(exc, "rank %s: %s", rank, exc)
    elif isinstance(exc, ElastictrainError):
        if claim_line(exc):
            _log_error(exc, "rank %s stopped in state %s at step %d: %s", rank, state, step, exc)
        if not exc.retryable:
            dist.record_fatal_error(ctx, exc)
    elif is_peer_loss(exc):
        fatal = dist.recorded_fatal_error(ctx)
        if fatal is not None:  # the peer stopped on purpose: its error is the cause, not the connection it closed
            lost = PeerLost(
                f"rank {rank} stopped in state {state} at step {step} because rank {fatal['rank']} stopped "
                f"on a {fatal['kind']} no restart can fix (its line is above)"
            )
        else:
            lost = PeerLost(
                f"rank {rank} lost a peer in state {state} at step {step} ({peer_loss_reason(str(exc))}); "
                "the launcher restarts the group from the newest snapshot"
            )
        _log_error(lost, "%s", lost)
        return lost
    else:
        first = record_crash(exc, step)
        if first is not None:
            repeated = RepeatedCrash(
                f"{one_line(exc, 300, kind=True)} again in state {state} at step {step}, as in "
                f"attempt {first.restart} on rank {first.rank} (its traceback is above): a restart replays the same "
                "steps, so this is a bug to fix, not a fault; no more restarts, every snapshot is kept"
            )
            if claim_line(repeated):
                _log_error(repeated, "rank %s: %s", rank, repeated)
            dist.record_fatal_error(ctx, repeated)
            return repeated
        _log_error(exc, "rank %s failed in state %s at step %d", rank, state, step, traceback=True)
    return None


def _log_error(exc: BaseException, message: str, *args: object, traceback: bool = False) -> None:
    """Log the line that says ``exc`` (a bug: with its traceback); marked, so that neither Python's hook nor the
    command line prints it again."""
    log.error(message, *args, exc_info=exc if traceback else None)
    if log.isEnabledFor(logging.ERROR):  # log.level=CRITICAL: what the hook prints is all the user reads
        mark_logged(exc)


def report_left_early(rank: str, step: int, last_committed: Committed | None, ctx: dist.DistContext | None) -> None:
    """A rank left its session (no error) before the run was done: a warning; with peers, also an error for the
    launcher, since they lose this rank and restart, and it would leave at the same step again."""
    resumes = last_committed.step if last_committed else "none: a fresh start"
    if ctx is None or not ctx.distributed:
        log.warning(
            "rank %s left the session at step %d before the run was done; the next launch resumes from the "
            "newest snapshot (step %s)",
            rank,
            step,
            resumes,
        )
        return
    error = UsageError(
        f"rank {rank} left the session at step {step} before the run was done while the other ranks trained on: "
        "every rank runs session.epochs() to its end (or all leave at the same step), calling session.step() once "
        "per optimizer step"
    )
    # Said now; under torchrun also recorded, so that when the other ranks fail for the want of this one, no
    # restart follows (launch.py, fatal.py). If every rank left at this step the job simply ends.
    claim_line(error)
    log.warning("%s; the next launch resumes from the newest snapshot (step %s)", error, resumes)
    dist.record_fatal_error(ctx, error)


def used_after_the_block(call: str) -> UsageError:
    """A session used after its ``with`` block ended: a loop dedented out of it, most often. Its process group is
    gone (under torchrun: torch's "process group not initialized"), and in one process it would train unseen."""
    return UsageError(
        f"{call or 'the session'} after the `with Session(...)` block ended: indent the training loop "
        "inside `with Session(...) as session:`, where the session restores, steps and snapshots"
    )


def peer_loss_reason(text: str, limit: int = 160) -> str:
    """A collective's error in a few words: its first sentence without the source location, cut at a word."""
    reason = " ".join(text.split())
    reason = re.sub(r"^\[[^\]\s]+:\d+\] ", "", reason)  # gloo's "[/path/to/pair.cc:553] "
    reason = re.split(r"(?<=\.) (?=[A-Z])", reason, maxsplit=1)[0]
    if len(reason) <= limit:
        return reason
    return reason[:limit].rsplit(" ", 1)[0] + " ..."


def is_peer_loss(exc: BaseException) -> bool:
    """A collective that failed because another rank went away (gloo/nccl errors, collective timeouts)."""
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "[/gloo/",
            "gloo/transport",
            "Timed out waiting",
        )
    )
