"""Snapshot storage on any fsspec URL: payload objects first, manifest last.

A snapshot is the prefix ``<root>/step-<N>/`` holding payload objects and ``manifest.json``
(``manifest.py``). ``SnapshotStore`` is the one object callers hold; each of its jobs is a
module of its own:

- ``store_client.py``: every store call, with one retry budget per operation, bounded time on
  s3:// and one-line errors (what failed, where, what to do; never a secret);
- ``commit.py``: writing a snapshot (checksummed while streaming, fsynced, manifest last) and
  removing the torn prefix of a commit that failed;
- ``catalog.py``: listing, reading and verifying, picking the newest valid snapshot, pruning;
- ``lease.py``: the run id kept in the store and the lease that keeps two runs from writing it.
"""

from __future__ import annotations

from fsspec import AbstractFileSystem

from elastictrain.storage.catalog import Catalog
from elastictrain.storage.commit import Committer, Writer
from elastictrain.storage.hashing import CommitTimings
from elastictrain.storage.lease import StoreLease, run_id
from elastictrain.storage.manifest import Manifest, ObjectEntry, SnapshotListing, Verified, snapshot_id_for_step
from elastictrain.storage.store_client import StoreClient


class SnapshotStore:
    """Commit, list, verify and prune snapshots under one fsspec URL; hold the store's lease.

    ``last_commit_timings`` says where the last commit's time went. ``recycle_keep_last``: see
    ``commit.Committer``. Every method raises only ``StorageError``/``StorageUnavailable`` for the
    store's failures (``store_client.py``).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict | None = None,
        *,
        retry_for_s: float = 20.0,
        recycle_keep_last: int = 0,
        url_key: str = "snapshot.durable.url",
    ):
        self.client = StoreClient(url, storage_options, retry_for_s=retry_for_s, url_key=url_key)
        self.catalog = Catalog(self.client)
        self.committer = Committer(self.client, self.catalog, recycle_keep_last)
        self.lease = StoreLease(self.client)

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def url_key(self) -> str:
        return self.client.url_key

    @property
    def retry_for_s(self) -> float:
        return self.client.retry_for_s

    @property
    def fs(self) -> AbstractFileSystem:
        return self.client.fs

    @property
    def root(self) -> str:
        return self.client.root

    @property
    def recycle_keep_last(self) -> int:
        return self.committer.recycle_keep_last

    @property
    def last_commit_timings(self) -> CommitTimings | None:
        return self.committer.last_timings

    def check_writable(self) -> None:
        """Write, read back and delete a probe object; StorageError if the store refuses, within bounded time."""
        self.client.check_writable()

    def commit(
        self,
        step: int,
        writers: dict[str, Writer],
        meta: dict,
        written: dict[str, ObjectEntry] | None = None,
        recycle: bool = True,
    ) -> Manifest:
        """Write every writer's object for `step`, then the manifest that makes it exist (listing ``written`` too:
        objects other processes already wrote under the prefix, after ``clear_prefix``). ``recycle``: False leaves
        every older snapshot as it is."""
        return self.committer.commit(step, writers, meta, written, recycle)

    def prefix_url(self, step: int) -> str:
        """The URL of `step`'s prefix, for writers of our own objects there (sharded.py)."""
        path = self.client.path(snapshot_id_for_step(step))
        return path if self.client.is_local else self.fs.unstrip_protocol(path)

    def clear_prefix(self, step: int) -> None:
        """Before others write `step`'s objects: remove what a torn or older write of it left there."""
        prefix = self.client.path(snapshot_id_for_step(step))
        with self.client.operation(f"snapshot {self.client.where(snapshot_id_for_step(step))} could not be cleared"):
            if self.client.call("find", prefix):
                self.client.call("rm", prefix, recursive=True)
            if self.client.is_local:
                self.client.call("makedirs", prefix, exist_ok=True)

    def list_snapshots(self) -> list[SnapshotListing]:
        """List step-* prefixes holding at least one object, oldest first, each with its manifest or why it has none."""
        return self.catalog.list_snapshots()

    def read_verified(self, snapshot_id: str) -> Verified:
        """Read a snapshot, checking each object's size and checksum; SnapshotError if one differs."""
        return self.catalog.read_verified(snapshot_id)

    def latest_valid(self, newer_than: int = -1, below: int | None = None) -> Verified | None:
        """Newest snapshot above step ``newer_than`` (and below ``below``) that verifies; None if there are none,
        SnapshotError if none verifies."""
        return self.catalog.latest_valid(newer_than, below)

    def prune(self, keep_last: int) -> list[str]:
        """After a commit, keep the newest `keep_last` intact snapshots and delete older ones (and torn ones below them)."""
        return self.catalog.prune(keep_last)

    def run_id(self) -> str:
        """The id of the run this store belongs to (``lease.run_id``)."""
        return run_id(self.client)

    def acquire_lease(self, owner: dict, stale_after_s: float) -> None:
        """Take the store's lease for this run, or raise StoreLeaseError naming the live run that holds it (``lease.py``)."""
        self.lease.acquire(owner, stale_after_s)

    def renew_lease(self) -> None:
        """Refresh the lease this store holds; StoreLeaseError if another run took it over."""
        self.lease.renew()

    def release_lease(self) -> None:
        """Delete the lease if this run still holds it; another run's lease is left alone."""
        self.lease.release()
