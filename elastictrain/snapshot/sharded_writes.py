"""dist.strategy=fsdp, the durable tier: every rank writes its own shards into a snapshot's prefix.

Rank 0 clears the step's prefix first (a torn or older write of it must not survive beside the new
shards), every rank writes its shards (``sharded.py``, DCP) and hashes its share of the files, and
rank 0 gathers the checksums for the manifest that ``Snapshotter`` commits last. With
``snapshot.durable.async_write`` the same runs on every rank's writer thread from staged shards, over
a gloo process group of the writers' own, made once by the training threads (``side_group``), so the
training thread's collectives go on meanwhile on the default group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from elastictrain.core import failpoints
from elastictrain.core.errors import StorageError
from elastictrain.dist.collectives import broadcast_from_main, gather_to_main
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.sharded import ShardedState, ShardFiles
from elastictrain.storage.manifest import ObjectEntry
from elastictrain.storage.snapshot_store import SnapshotStore


class ShardedWrites:
    """Write every rank's shards of one step into ``store``; rank 0 learns every file's checksum."""

    def __init__(self, sharded: ShardedState, store: SnapshotStore, ctx: DistContext) -> None:
        self.sharded = sharded
        self.store = store
        self.ctx = ctx
        self._group: Any = None  # the writer threads' own process group (side_group)

    def write(self, step: int) -> dict[str, ObjectEntry] | None:
        """Every rank, on the training thread: this rank's live shards into the step's prefix; rank 0 returns every
        rank's checksums, the others None. A failure raises StorageError on every rank."""
        error = self._clear_prefix(step)
        error = broadcast_from_main(
            error, self.ctx
        )  # before any rank writes: DCP's first collective (its plan) waits for rank 0 to get there
        if error is not None:
            raise StorageError(error)
        mine = self.sharded.save(self.store.prefix_url(step), self.ctx.rank, self.ctx.world_size, step)
        shares = gather_to_main(mine, self.ctx)
        return {name: entry for share in shares for name, entry in share.items()} if shares is not None else None

    def write_behind(self, step: int, shards: dict[str, Any]) -> ShardFiles:
        """Every rank's writer thread: its staged ``shards`` into the step's prefix over ``side_group``. Rank 0
        returns every rank's checksums once every rank's shards are written, or the first error; the other ranks
        nothing (rank 0 reports). A rank killed meanwhile leaves rank 0 waiting for nothing: no manifest."""
        group = self._group
        error, mine = broadcast_from_main(self._clear_prefix(step), self.ctx, group=group), {}
        failpoints.hit("shards-write", step)  # tests: hold a writer thread before its shards are written
        if error is None:
            try:
                mine = self.sharded.save(
                    self.store.prefix_url(step), self.ctx.rank, self.ctx.world_size, step, shards, group
                )
            except StorageError as exc:
                error = str(exc)
        shares = gather_to_main(ShardFiles(mine, error), self.ctx, group=group)
        every = ShardFiles()
        for share in shares or []:  # rank 0: every rank's share; the others: none
            every.keep(share)
        return every

    def side_group(self) -> Any:
        """The process group of the writer threads, made at the first background save by every rank's training thread."""
        if self._group is None and self.ctx.distributed:
            self._group = torch.distributed.new_group(
                backend="gloo", timeout=timedelta(seconds=self.ctx.collective_timeout_s)
            )
        return self._group

    def _clear_prefix(self, step: int) -> str | None:
        """Rank 0: the step's prefix emptied; why not, or None (the other ranks: None)."""
        if not self.ctx.is_main:
            return None
        try:
            self.store.clear_prefix(step)
        except StorageError as exc:
            return str(exc)
        return None
