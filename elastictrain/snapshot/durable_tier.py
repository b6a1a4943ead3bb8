"""The durable tier (``snapshot.durable``): rank 0 writes the store, every rank agrees on the outcome, and restores.

Saving gathers every rank's RNG state on rank 0, which streams the model and every registered Stateful into the
store (manifest last), prunes, and then tells every rank the outcome in one broadcast, so all ranks agree at once
whether the snapshot exists and whether training goes on. Under fsdp every rank writes its shards
(``sharded_writes.py``) and rank 0 commits the manifest after them. Restoring has rank 0 read and verify the newest
valid snapshot and hand its bytes to every rank (``restore.py``).
"""

from __future__ import annotations

import time
from typing import Any

from elastictrain.core.config import Config
from elastictrain.core.errors import StorageError
from elastictrain.core.events import Committed, SnapshotReport, Tier
from elastictrain.core.rng import capture_rng
from elastictrain.dist.collectives import broadcast_from_main, gather_to_main, main_acts
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.background_write import PENDING, CommitOutcome
from elastictrain.snapshot.format import STATE_OBJECT
from elastictrain.snapshot.lease_keeper import LeaseKeeper
from elastictrain.snapshot.restore import FastTier, Restored, restore_newest
from elastictrain.snapshot.sharded_writes import ShardedWrites
from elastictrain.snapshot.snapshotter import Snapshotter, TierSettings


class DurableTier(Snapshotter):
    """``snapshot.durable``: rank 0 writes the store (every rank its shards under fsdp) and every rank agrees on the
    outcome in one broadcast; a write that fails for good stops the run by default (``snapshot.durable.on_error``)."""

    tier = Tier.DURABLE

    @staticmethod
    def settings_from(cfg: Config, ctx: DistContext) -> TierSettings:
        durable = cfg.snapshot.durable
        return TierSettings(
            url=cfg.durable_snapshot_url,
            storage_options=durable.storage_options,
            retry_for_s=durable.retry_for_s,
            keep_last=durable.keep_last,
            on_error=durable.on_error,
            is_writer=ctx.is_main,
            asynchronous=durable.async_write,
            recycle_keep_last=0,
            # the key that set its URL: a run.dir that cannot be written is fixed in run.dir
            url_key="snapshot.durable.url" if durable.url else "run.dir",
        )

    def _attach(self) -> None:
        self._run_id = ""
        # fsdp: every rank writes its shards into the store (sharded_writes.py), rank 0 commits the manifest after them.
        self.shard_writes = ShardedWrites(self.sharded, self.store, self.ctx) if self.sharded is not None else None

    # -- restore ------------------------------------------------------------------------------

    def restore(self, fast: FastTier | None = None) -> Restored | None:
        """Load the newest valid snapshot on every rank; None when training starts fresh.

        With a fast tier, every node offers the newest copy it holds and verifies; the durable
        store is read only when it holds a newer one (``restore.py``).
        """
        started = time.monotonic()  # the restore's duration counts opening the store too
        self._run_id = self._open_store()
        return restore_newest(self, fast, self._run_id, started)

    def roll_back(self, fast: FastTier | None, keep: tuple[str, ...]) -> Restored | None:
        """ROLLBACK: ``restore`` again in this process, the store open, the objects in ``keep`` left alone."""
        return restore_newest(self, fast, self._run_id, time.monotonic(), keep)

    def _open_store(self) -> str:
        """Rank 0 checks that the durable store is writable, takes its lease and reads the run's id; every rank
        returns the id, or raises rank 0's error."""

        def open_on_main() -> str:
            self.store.check_writable()
            self._lease = LeaseKeeper(self.store, self.cfg, self.ctx)
            self._lease.start()
            return self.store.run_id()

        return main_acts(open_on_main, self.ctx)

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any]) -> SnapshotReport | None:
        """Take a snapshot of this step on every rank; every rank returns the same report or raises the same error.

        Written in the background (``snapshot.durable.async_write``), it returns None: the report comes
        from ``poll`` once the write is done, and ``flush`` waits for it.
        """
        started = time.monotonic()
        mine = {"rng": capture_rng(self.ctx.device), **self.rank_state()}
        shards_async = self.sharded is not None and self.asynchronous
        written = self.shard_writes.write(step) if self.shard_writes is not None and not shards_async else None
        rank_states = gather_to_main(mine, self.ctx)
        shards: dict = {}
        if shards_async:  # every rank: the write in flight finished (one at a time), this rank's shards staged
            assert self.shard_writes is not None and self.sharded is not None
            self.shard_writes.side_group()
            self._writes.join()
            shards = self.sharded.stage()
        outcome = None
        if rank_states is not None:  # rank 0
            if shards_async:
                outcome = self._start_shard_write(step, rank_states, meta, started, shards)
            elif self.asynchronous:
                outcome = self._start_write(step, rank_states, meta, started)
            else:
                model_state = None if written is not None else self.model.state_dict()
                outcome = self._commit(step, model_state, self._state_dict(rank_states), meta, started, written)
        # The one point where all ranks learn the outcome together: nobody trains on while
        # rank 0 is about to stop, and nobody waits on a collective for a rank that left.
        outcome = broadcast_from_main(outcome, self.ctx)
        if outcome.stop:
            raise StorageError(outcome.error)
        if shards_async and not self.ctx.is_main:  # rank 0 started its write: the others write their shards alongside
            self._writes.start(step, 0.0, lambda: self._commit_behind(step, shards))
        if outcome.committed and not self.ctx.is_main:
            self.last_committed = Committed(step, time.time())  # every rank knows the newest committed step
        if self.asynchronous and outcome.error is None:
            return None
        return outcome.report(step, time.monotonic() - started, self.tier)

    def _start_shard_write(
        self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float, shards: dict
    ) -> CommitOutcome:
        """fsdp with async_write, rank 0: its staged shards and the staged state written in a thread, the manifest
        committed after every rank's shards."""
        refused = self._refused(step)
        if refused is not None:
            return refused
        state = self._stager.stage({STATE_OBJECT: self._state_dict(rank_states)})[STATE_OBJECT]
        blocked_s = time.monotonic() - started
        self._writes.start(step, blocked_s, lambda: self._commit_behind(step, shards, state, meta))
        return PENDING

    def _commit_behind(
        self, step: int, shards: dict, state: dict | None = None, meta: dict | None = None
    ) -> CommitOutcome:
        """fsdp with async_write, every rank's writer thread: its staged shards written (``sharded_writes.py``); rank 0
        commits the manifest last, once every rank's shards are written."""
        assert self.shard_writes is not None  # fsdp's durable tier
        files = self.shard_writes.write_behind(step, shards)
        if not self.ctx.is_main:
            return PENDING  # rank 0 reports the outcome
        if files.error is not None:
            stop = self.on_error == "stop"
            return CommitOutcome(error=self._fell_behind(step, StorageError(files.error), stop), stop=stop)
        assert state is not None and meta is not None  # rank 0 passes them
        return self._commit(step, None, state, meta, time.monotonic(), files.written)
