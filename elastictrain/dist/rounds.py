"""Every rendezvous round gets an identity all of its ranks agree on, so its store keys are its own.

torchrun (c10d and etcd-v2 rendezvous) hands the workers of every round the same long-lived store
and tells them nothing about the round. ``TORCHELASTIC_RESTART_COUNT`` is each agent's own count
of failed attempts, and a membership change is not counted (torch 2.13
``elastic/agent/server/api.py``: "membership changes do not count as retries"; pytorch#135712).
Keyed by it, the workers of a node that joins (count 0) and those of a survivor (count n) build
different keys and never meet, and a later round can read the keys of a dead one.

So the ranks of a round agree on a fresh nonce through the store itself. A new process cannot tell
a key its peers wrote just now from one that a dead worker left, hence a handshake:

1. rank 0 draws a fresh nonce;
2. every other rank ``r`` draws a fresh token and writes it to ``req/<r>``;
3. rank 0 polls ``req/<r>`` and answers every token it sees with ``resp/<token> = nonce``; a stale
   token, left by a dead worker, gets an answer nobody reads;
4. rank ``r`` waits for ``resp/<its token>`` and confirms with ``ack/<nonce>/<r>``;
5. rank 0 answers until every rank has confirmed, then removes the keys of the handshake.

Every rank of the round ends with the same nonce, and no two rounds share one. Each wait is bounded
by ``timeout_s``; running out is a one-line ``DistributedSetupError`` that names the missing ranks.
Both sides poll in Python rather than block in the store, so a launcher's signal (a peer died
before it joined) ends the wait at once, and the rank says whom it was waiting for.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from elastictrain.core.errors import DistributedSetupError
from elastictrain.core.signals import SignalledInSetup

POLL_INTERVAL_S = 0.01


def agree_on_round(
    store: Any, rank: int, world_size: int, timeout_s: float, poll_interval_s: float = POLL_INTERVAL_S
) -> str:
    """The nonce of this round, the same on every rank of it (a store namespaced to the run)."""
    if rank == 0:
        return _lead(store, world_size, timeout_s, poll_interval_s)
    return _follow(store, rank, timeout_s, poll_interval_s)


def _follow(
    store: Any,
    rank: int,
    timeout_s: float,
    poll_interval_s: float = POLL_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    token = uuid.uuid4().hex
    store.set(f"round/req/{rank}", token)
    answer = f"round/resp/{token}"
    deadline = clock() + timeout_s
    try:
        while not store.check([answer]):
            if clock() > deadline:
                raise DistributedSetupError(
                    f"rank {rank} got no answer from rank 0 within {timeout_s:g}s while agreeing on the rendezvous "
                    "round (rank 0 did not start, or died); the launcher restarts the group (dist.init_timeout_s "
                    "sets the wait)"
                )
            time.sleep(poll_interval_s)  # a signal handler runs here, not inside a blocking store call
    except SignalledInSetup as signalled:
        raise signalled.waiting("the process group (rank 0 never joined)") from None
    except RuntimeError:  # torch's DistStoreError (a RuntimeError): the store went away
        raise DistributedSetupError(
            f"rank {rank} lost the rendezvous store while waiting for rank 0 to agree on the rendezvous round; "
            "the launcher restarts the group"
        ) from None
    nonce = store.get(answer).decode()
    store.set(f"round/ack/{nonce}/{rank}", token)
    return nonce


def _lead(
    store: Any, world_size: int, timeout_s: float, poll_interval_s: float, clock: Callable[[], float] = time.monotonic
) -> str:
    nonce = uuid.uuid4().hex[:16]
    deadline = clock() + timeout_s
    answered: dict[int, str] = {}  # rank -> the last token answered for it
    pending = set(range(1, world_size))
    try:
        while pending:
            for rank in sorted(pending):
                request = f"round/req/{rank}"
                if store.check([request]):
                    token = store.get(request).decode()
                    if answered.get(rank) != token:
                        store.set(f"round/resp/{token}", nonce)
                        answered[rank] = token
                if store.check([f"round/ack/{nonce}/{rank}"]):
                    pending.discard(rank)
            if not pending:
                break
            if clock() > deadline:
                raise DistributedSetupError(
                    f"rank 0: rank(s) {_listed(pending)} of {world_size} did not check in within {timeout_s:g}s while "
                    "agreeing on the rendezvous round; the launcher restarts the group (dist.init_timeout_s sets the wait)"
                )
            time.sleep(poll_interval_s)
    except SignalledInSetup as signalled:
        raise signalled.waiting(
            f"the process group (rank(s) {_listed(pending)} of {world_size} never joined)"
        ) from None
    # Every rank has its answer: the handshake's keys would only be stale tokens for the next round.
    for rank, token in answered.items():
        for key in (f"round/req/{rank}", f"round/resp/{token}", f"round/ack/{nonce}/{rank}"):
            store.delete_key(key)
    return nonce


def _listed(ranks: set[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))
