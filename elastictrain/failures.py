"""Why a rank stopped, said once in one line: a traceback only for bugs.

An elastictrain error (bad input, a store that is gone) is one line, said once on the node
(fatal.py), and recorded for the restarts when no restart can help; a signal during SETUP ends the
rank quietly; a collective that failed because a peer went away becomes ``PeerLost``, which the
launcher's restart answers. Anything else is a bug: its traceback is logged.
"""

from __future__ import annotations

import logging

import torch

from . import dist
from .errors import ElastictrainError, PeerLost, RepeatedFatalError
from .fatal import claim_line
from .signals import SignalledInSetup, requeue_slurm_job

log = logging.getLogger("elastictrain")


def report_failure(exc: BaseException, rank: str, state: str, step: int, ctx: dist.DistContext | None,
                   requeue: bool) -> PeerLost | None:
    """Log why this rank stopped; a ``PeerLost`` to raise instead of ``exc`` when a peer was lost."""
    if isinstance(exc, SignalledInSetup):  # no traceback: the launcher (or the user) asked it to stop
        log.error("%s", exc.line(rank))
        if requeue and rank == "0":
            requeue_slurm_job()
    elif isinstance(exc, RepeatedFatalError):
        if claim_line(exc):  # under torchrun: said once on this node (fatal.py)
            log.error("rank %s: %s", rank, exc)
    elif isinstance(exc, ElastictrainError):
        if claim_line(exc):
            log.error("rank %s stopped in state %s at step %d: %s", rank, state, step, exc)
        if not exc.retryable:
            dist.record_fatal_error(ctx, exc)
    elif is_peer_loss(exc):
        reason = " ".join(str(exc).split())[:160]
        lost = PeerLost(f"rank {rank} lost a peer in state {state} at step {step} ({reason}); "
                        "the launcher restarts the group from the newest snapshot")
        log.error("%s", lost)
        return lost
    else:
        log.exception("rank %s failed in state %s at step %d", rank, state, step)
    return None


def is_peer_loss(exc: BaseException) -> bool:
    """A collective that failed because another rank went away (gloo/nccl errors, collective timeouts)."""
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "[/gloo/", "gloo/transport", "Timed out waiting")
    )
