"""Rank 0 holds the durable store's lease for the job and renews it from a daemon thread (``lease.py``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from elastictrain.core.config import Config
from elastictrain.core.errors import ElastictrainError, StoreLeaseError
from elastictrain.dist.group import DistContext
from elastictrain.storage.snapshot_store import SnapshotStore

log = logging.getLogger("elastictrain")

TORCHRUN_DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id when none is given: shared by unrelated jobs


class LeaseKeeper:
    """Holds the store's lease for this job on rank 0 and renews it from a daemon thread.

    The token is shared by every attempt of one job (torchrun's --rdzv-id, else a token kept in
    its agent's store; the SLURM job id), so a restarted attempt takes its own lease over while
    another job is refused.
    """

    def __init__(self, store: SnapshotStore, cfg: Config, ctx: DistContext) -> None:
        self.store = store
        self.stale_after_s = cfg.snapshot.durable.lease_stale_after_s
        self.owner = {
            "run_id": f"{cfg.run.name} ({ctx.env.launcher} {ctx.env.run_id})",
            "token": job_token(ctx),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_unix": time.time(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: StoreLeaseError | None = None  # set when another run has taken the lease

    def start(self) -> None:
        if self.stale_after_s <= 0:
            return
        self.store.acquire_lease(self.owner, self.stale_after_s)
        self._thread = threading.Thread(target=self._renew, name="elastictrain-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        interval = max(1.0, self.stale_after_s / 4)
        while not self._stop.wait(interval):
            try:
                self.store.renew_lease()
            except StoreLeaseError as exc:  # another run took the store over: never write beside it
                self.lost = exc
                log.error("%s", exc)
                return
            except ElastictrainError as exc:  # an outage: the lease ages; the next renewal may succeed
                log.debug("lease renewal failed: %s", exc)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        try:
            self.store.release_lease()
        except ElastictrainError as exc:
            log.warning(
                "could not release the snapshot store's lease (%s); it goes stale in %.0f s", exc, self.stale_after_s
            )


def job_token(ctx: DistContext) -> str:
    """The token every attempt of this job shares (see ``LeaseKeeper``)."""
    if ctx.env.launcher == "torchrun" and ctx.env.run_id != TORCHRUN_DEFAULT_RUN_ID:
        # --rdzv-id names the job on every node, and outlives the store: when the node hosting the
        # workers' store is lost (etcd rendezvous), the new rank 0 hosts a new one.
        return f"torchrun {ctx.env.run_id}"
    if ctx.run_store is not None:
        # compare_set sets the key only if it is absent: the first attempt's token wins for all.
        return ctx.run_store.compare_set("lease_token", "", uuid.uuid4().hex).decode()
    if ctx.env.launcher == "slurm":
        return ctx.env.run_id  # slurm-<job id>: a requeued job keeps its id
    return uuid.uuid4().hex
