"""What both snapshot tiers share: from live objects to committed bytes, on the tier's writer.

``Snapshotter`` holds the objects saved, the commit (payload objects, a manifest last with each object's checksum,
pruning), background writes and their reports. ``DurableTier`` (``durable_tier.py``: rank 0 writes, every rank
agrees on the outcome, restores) and ``LocalTier`` (``local_tier.py``: each node's fast copies) are the two kinds,
each with a ``TierSettings`` read once from the config.

A store that cannot be reached is retried by the store (with backoff, ``snapshot.durable.retry_for_s``)
and then given up *for this snapshot only*: training goes on, one warning says since when
snapshots are behind, and the next interval tries again. A write that fails for good (disk
full, permission denied) stops the run cleanly by default (``snapshot.durable.on_error``).

Its helpers, each a module: ``background_write.py`` (``async_write``: one write in flight on a thread),
``lease_keeper.py`` (rank 0 holds the durable store's lease), ``staging.py``. It imports nothing of the loop: the
loop hands it the objects to save.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from elastictrain.core import failpoints
from elastictrain.core.config import Config
from elastictrain.core.errors import StorageError, StorageUnavailable
from elastictrain.core.events import Committed, SnapshotReport, Tier
from elastictrain.dist.collectives import broadcast_from_main
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.background_write import PENDING, BackgroundWrites, CommitOutcome
from elastictrain.snapshot.format import (
    FORMAT_VERSION,
    MODEL_OBJECT,
    STATE_OBJECT,
    save_object,
    writer_for,
)
from elastictrain.snapshot.lease_keeper import LeaseKeeper
from elastictrain.snapshot.sharded import SHARDED, ShardedState
from elastictrain.snapshot.staging import Stager
from elastictrain.storage.commit import Writer
from elastictrain.storage.snapshot_store import SnapshotStore

log = logging.getLogger("elastictrain")


@dataclass(frozen=True)
class TierSettings:
    """Where a tier writes and how: what tells the durable store from a node's fast tier, read once from the config."""

    url: str
    storage_options: dict[str, Any]
    retry_for_s: float  # how long the store retries a call before this snapshot is given up
    keep_last: int
    on_error: str  # "stop": a write that fails for good stops the run; "continue": a warning, training goes on
    is_writer: bool  # this rank writes the tier's snapshots
    asynchronous: bool  # staged at the step boundary, written on a thread
    recycle_keep_last: int  # the store reuses pruned snapshots' files (storage/snapshot_store.py)
    url_key: str  # the key a message about the tier's store tells the user to change


class Behind(NamedTuple):
    """Snapshots are behind: since this step's was not committed, at this time."""

    step: int
    unix: float


class Snapshotter:
    """What both tiers share: the objects saved, the commit (manifest last), background writes, their reports.

    ``DurableTier`` (below) and ``LocalTier`` (``local_tier.py``) are the two kinds; each says where it writes
    (``TierSettings``) and how its ranks take a snapshot (``save``).
    """

    tier: Tier  # the tier its reports name (each tier says)

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        model: nn.Module,
        statefuls: dict[str, Any],
        train_samples: int | None = None,
        rank_statefuls: dict[str, Any] | None = None,
    ) -> None:
        settings = self.settings_from(cfg, ctx)
        self.cfg, self.ctx, self.settings = cfg, ctx, settings
        self.keep_last, self.on_error, self.is_writer = settings.keep_last, settings.on_error, settings.is_writer
        self.asynchronous = settings.asynchronous
        # Statefuls whose state differs per rank (a stream's position), saved as one entry per rank.
        self.rank_statefuls = rank_statefuls or {}
        self.train_samples = train_samples  # the data position counts samples: another size is another dataset
        self.model = model  # the unwrapped module: its weights are the model object
        self.statefuls = statefuls
        self.store = SnapshotStore(
            settings.url,
            settings.storage_options,
            retry_for_s=settings.retry_for_s,
            recycle_keep_last=settings.recycle_keep_last,
            url_key=settings.url_key,
        )
        self.last_committed: Committed | None = None  # the newest committed snapshot
        self._behind_since: Behind | None = None  # the first snapshot not committed while behind
        self._lease: LeaseKeeper | None = None
        self._stager = Stager()  # async writes: stage into reused buffers, write in a thread, one at a time
        self._writes = BackgroundWrites(self.tier)  # fsdp: on every rank, each writing its shards
        # dist.strategy=fsdp: the model and optimizers are every rank's own shards, written by every rank (sharded.py).
        optimizers = [c for c in statefuls.values() if isinstance(c, torch.optim.Optimizer)]
        self.sharded = (
            ShardedState(model, optimizers, settings.storage_options) if cfg.dist.strategy == "fsdp" else None
        )
        self._attach()

    @staticmethod
    def settings_from(cfg: Config, ctx: DistContext) -> TierSettings:
        """Where the tier writes and how, from the config (each tier says)."""
        raise NotImplementedError

    def _attach(self) -> None:
        """The tier's own parts, made once the shared ones are (each tier says)."""

    def save(self, step: int, meta: dict[str, Any]) -> SnapshotReport | None:
        """Take a snapshot of this step on every rank (the tier says how)."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        return self.store.url

    def rank_state(self) -> dict[str, Any]:
        """This rank's share of a snapshot besides its RNG: its streams' positions, its metric sums since the last reduce."""
        return {name: component.state_dict() for name, component in self.rank_statefuls.items()}

    def rank_state_now(self) -> dict[str, Any] | None:
        """``rank_state`` at every step (survivor copies): None where reading it would wait for the device."""
        state = {
            name: component.peek() if hasattr(component, "peek") else component.state_dict()
            for name, component in self.rank_statefuls.items()
        }
        return None if any(value is None for value in state.values()) else state

    # -- asynchronous writes: stage at the step boundary, write in the background ----------

    def _start_write(self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float) -> CommitOutcome:
        """The writer: wait for the write in flight, stage this step's state into reused buffers, write it in a thread."""
        refused = self._refused(step)
        if refused is not None:
            return refused
        staged = self._stager.stage(
            {MODEL_OBJECT: self.model.state_dict(), STATE_OBJECT: self._state_dict(rank_states)}
        )
        blocked_s = time.monotonic() - started
        self._writes.start(
            step,
            blocked_s,
            lambda: self._commit(step, staged[MODEL_OBJECT], staged[STATE_OBJECT], meta, time.monotonic()),
        )
        return PENDING

    def _refused(self, step: int) -> CommitOutcome | None:
        """Before a background write: the one in flight finished (staging reuses the buffers it wrote from), and why
        this one must not start (the last one failed for good, the store's lease is lost), or None."""
        self._writes.join()
        if self._writes.failed is not None:
            return CommitOutcome(error=self._writes.failed, stop=True)
        if self._lease is not None and self._lease.lost is not None:
            return CommitOutcome(error=f"snapshot at step {step} not written: {self._lease.lost}", stop=True)
        return None

    def poll(self) -> list[SnapshotReport]:
        """Rank 0, between steps: the reports of background writes finished since the last poll."""
        return self._writes.poll()

    def finish_writes(self) -> list[SnapshotReport]:
        """This process's write in flight, finished, and the reports not yet polled (a fast tier's, before a rollback)."""
        self._writes.join()
        return self._writes.poll()

    @property
    def write_failed(self) -> bool:
        """Rank 0: a background write failed for good (or crashed); the ranks must stop at the next vote."""
        return self._writes.failed is not None

    def raise_write_failure(self) -> None:
        """Every rank, once the vote agreed that rank 0's background write failed: stop with one line."""
        if self._writes.crash is not None:
            raise self._writes.crash  # a bug in the writer keeps its traceback
        raise StorageError(
            self._writes.failed
            or "rank 0's background snapshot write failed for good (its log says why); "
            "the next launch resumes from the newest committed snapshot"
        )

    def flush(self) -> list[SnapshotReport]:
        """Every rank, before DONE and PREEMPTED: wait for the background write and agree on its outcome."""
        if not self.asynchronous:
            return []
        outcome = None
        if self.ctx.is_main:
            self._writes.join()
            outcome = (self.poll(), self._writes.failed)
        elif self.sharded is not None:  # this rank's shards written (rank 0's commit waits for them)
            self._writes.join()
            self._writes.poll()
        reports, failed = broadcast_from_main(outcome, self.ctx)
        if failed is not None:
            self._writes.failed = failed
            self.raise_write_failure()
        committed = [report.step for report in reports if report.committed]
        if committed and not self.ctx.is_main:
            self.last_committed = Committed(committed[-1], time.time())
        return reports

    # -- the commit itself (rank 0) -----------------------------------------------------------

    def _commit(
        self,
        step: int,
        model_state: dict[str, Any] | None,
        state: dict[str, Any],
        meta: dict[str, Any],
        started: float,
        written: dict | None = None,
        prune: bool = True,
    ) -> CommitOutcome:
        def write_state(fileobj: Any) -> None:
            failpoints.hit("snapshot-write", step)  # tests: kill rank 0 after model.pt, before state.pt
            save_object(state, fileobj)  # torch.save without the zip CRC-32: the store checksums every byte

        writers: dict[str, Writer] = {STATE_OBJECT: write_state}
        if model_state is not None:  # None: the ranks wrote the model's shards (``written``)
            writers[MODEL_OBJECT] = writer_for(model_state)
        else:
            meta = {**meta, "sharded": SHARDED}
        if self._lease is not None and self._lease.lost is not None:
            return CommitOutcome(error=f"snapshot at step {step} not written: {self._lease.lost}", stop=True)
        try:
            # prune=False: no older snapshot is pruned, nor taken over by this one (the fast tier's recycling)
            manifest = self.store.commit(step, writers, {**meta, "format_version": FORMAT_VERSION}, written, prune)
        except StorageError as exc:
            stop = not isinstance(exc, StorageUnavailable) and self.on_error == "stop"
            return CommitOutcome(error=self._fell_behind(step, exc, stop), stop=stop)
        self.last_committed = Committed(step, manifest.created_unix)
        try:
            pruned = self.store.prune(self.keep_last) if prune else []
        except StorageError as exc:  # old snapshots stay a little longer; the new one is safe
            log.warning("snapshot %s committed, but pruning older ones failed: %s", manifest.snapshot_id, exc)
            pruned = []
        size = sum(entry.size for entry in manifest.objects.values())
        log.info(
            "snapshot %s/%s committed: %d bytes in %.3fs%s",
            self.store.url,
            manifest.snapshot_id,
            size,
            time.monotonic() - started,
            f" (pruned {', '.join(pruned)})" if pruned else "",
        )
        if self._behind_since is not None:
            log.info("snapshots caught up at step %d after %.0f s behind", step, time.time() - self._behind_since.unix)
            self._behind_since = None
        return CommitOutcome(committed=True, size_bytes=size)

    def _fell_behind(self, step: int, exc: StorageError, stop: bool) -> str:
        if self._behind_since is None:
            self._behind_since = Behind(step, time.time())
        if self.last_committed is None:
            last = "no snapshot of this run is committed yet"
        else:
            newest = self.last_committed
            last = (
                f"the newest committed one is step {newest.step} from "
                f"{time.strftime('%H:%M:%S', time.localtime(newest.unix))}, {time.time() - newest.unix:.0f} s ago"
            )
        if stop:
            return (
                f"snapshot at step {step} failed: {exc}; stopping (snapshot.durable.on_error=stop); {last}; "
                "the next launch resumes from it"
            )
        log.warning(
            "snapshot at step %d not committed (%s); snapshots are behind since step %d: %s; training goes on "
            "and the next snapshot interval tries again",
            step,
            exc,
            self._behind_since.step,
            last,
        )
        return str(exc)

    def _state_dict(self, rank_states: list[dict]) -> dict[str, Any]:
        """Everything but the model weights; the model is its own payload object."""
        return {
            "format_version": FORMAT_VERSION,
            **{
                name: (c.state_dict() if c is not None else None)
                for name, c in self.statefuls.items()
                if not (self.sharded is not None and isinstance(c, torch.optim.Optimizer))
            },  # fsdp: in the shards
            "rng": [ranks["rng"] for ranks in rank_states],
            "rank_states": {name: [ranks[name] for ranks in rank_states] for name in self.rank_statefuls},
            "config": self.cfg.to_dict(redact=True),
            "env": {
                "world_size": self.ctx.world_size,
                "num_threads": torch.get_num_threads(),
                "torch_version": str(torch.__version__),  # TorchVersion is not a plain str
                "train_samples": self.train_samples,
            },
        }

    def close(self) -> None:
        # Leaving for any reason: a snapshot half written would be lost.
        self._writes.abandon(timeout_s=max(60.0, 3 * self.cfg.snapshot.durable.retry_for_s))
        if self._lease is not None:
            self._lease.stop()
            self._lease = None
