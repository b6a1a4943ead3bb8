"""What a store holds: list its snapshots, read one and verify every byte, pick the newest valid one, prune.

What reading relies on from an object store, and nothing more: single-key read-after-write (a
reader that GETs the manifest sees the object that was PUT; S3 has been strongly consistent for
this since December 2020, SeaweedFS and MinIO are too). Listing is used only to discover
candidate prefixes: every candidate is verified by reading its manifest and then every object's
bytes, so a listing that lags or shows a stale prefix cannot make a bad snapshot look good.
Prefixes that hold no object (the "directory" markers some stores, e.g. SeaweedFS, keep after
their objects are deleted) are not candidates, and ``prune`` deletes the marker too.
"""

from __future__ import annotations

import logging
import time

from elastictrain.core.errors import SnapshotError
from elastictrain.storage.hashing import checksum_bytes, mismatch
from elastictrain.storage.manifest import MANIFEST_NAME, SNAPSHOT_ID, Manifest, SnapshotListing, Verified
from elastictrain.storage.mapped import MappedFile, ObjectData, map_file
from elastictrain.storage.store_client import StoreClient

log = logging.getLogger("elastictrain.storage.snapshot_store")


class Catalog:
    """List, read, verify and prune the snapshots under one store's root."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client

    def list_snapshots(self) -> list[SnapshotListing]:
        """List step-* prefixes holding at least one object, oldest first, each with its manifest or why it has none."""
        with self.client.operation(f"cannot list {self.client.url}"):
            listings = []
            for snapshot_id in self.object_sizes():
                try:
                    manifest = self._read_manifest(snapshot_id)
                    problem = None if manifest else "no manifest (torn or in-progress write)"
                except SnapshotError as exc:
                    manifest, problem = None, f"manifest unreadable: {exc}"
                step = int(snapshot_id.removeprefix("step-"))  # object_sizes keeps only SNAPSHOT_ID's names
                listings.append(SnapshotListing(snapshot_id, step, manifest, problem))
            return sorted(listings, key=lambda listing: listing.step)

    def object_sizes(self) -> dict[str, dict[str, int]]:
        """step-* id -> {object name: size in bytes}, from one listing; prefixes without objects are absent."""
        client = self.client
        client.fs.invalidate_cache(client.root)  # object-store listings are cached; we need the truth
        try:
            found = client.call("find", client.root, withdirs=False, detail=True)
        except FileNotFoundError:
            found = {}
        if not found and client.is_s3:
            client.check_bucket()  # an empty listing of a missing bucket is a mistake, not a fresh store
        root = client.fs._strip_protocol(client.root).rstrip("/") + "/"
        sizes: dict[str, dict[str, int]] = {}
        for path, info in found.items():
            path = client.fs._strip_protocol(path)
            if not path.startswith(root):
                continue
            snapshot_id, sep, rest = path[len(root) :].partition("/")
            if sep and rest and SNAPSHOT_ID.match(snapshot_id):
                sizes.setdefault(snapshot_id, {})[rest] = info.get("size")
        return sizes

    def _read_object(self, snapshot_id: str, name: str) -> bytes | None:
        """Bytes of one object, None if it does not exist."""
        try:
            return self.client.call("cat_file", self.client.path(snapshot_id, name))
        except FileNotFoundError:
            return None

    def _read_payload(self, snapshot_id: str, name: str) -> bytes | MappedFile | None:
        """One payload object, None if it does not exist: on a local filesystem read once into memory of this process's
        own that torch.load maps (mapped.py)."""
        if not self.client.is_local:
            return self._read_object(snapshot_id, name)
        try:
            return self.client.call(map_file, self.client.path(snapshot_id, name))  # a plain path, as commit.py's
        except FileNotFoundError:
            return None

    def _read_manifest(self, snapshot_id: str) -> Manifest | None:
        """Parse one snapshot's manifest; None if it has none, SnapshotError if it is unusable."""
        data = self._read_object(snapshot_id, MANIFEST_NAME)
        if data is None:
            return None
        where = self.client.where(snapshot_id, MANIFEST_NAME)
        manifest = Manifest.from_json(data, where)
        if manifest.snapshot_id != snapshot_id:  # e.g. copied by hand into the wrong prefix
            raise SnapshotError(f"manifest {where} belongs to snapshot {manifest.snapshot_id!r}")
        return manifest

    def read_verified(self, snapshot_id: str) -> Verified:
        """Read a snapshot, checking each object's size and checksum; SnapshotError if one differs."""
        where = self.client.where(snapshot_id)
        corrupt = f"snapshot {where} is corrupt"
        read_s = verify_s = 0.0
        with self.client.operation(f"cannot read {where}"):
            try:
                manifest = self._read_manifest(snapshot_id)
            except SnapshotError as exc:
                raise SnapshotError(f"{corrupt}: {exc}") from exc
            if manifest is None:
                raise SnapshotError(f"{corrupt}: it has no {MANIFEST_NAME}")
            payload: dict[str, ObjectData] = {}
            for name, expected in sorted(manifest.objects.items()):
                started = time.perf_counter()
                data = self._read_payload(snapshot_id, name)
                read_s += time.perf_counter() - started
                if data is None:
                    raise SnapshotError(f"{corrupt}: object '{name}' is missing")
                started = time.perf_counter()
                problem = mismatch(expected, checksum_bytes(data, expected.algorithm))
                verify_s += time.perf_counter() - started
                if problem is not None:
                    raise SnapshotError(f"{corrupt}: object '{name}' {problem}")
                if isinstance(data, MappedFile):
                    data.forget_pages()
                payload[name] = data
            log.info(
                "read snapshot %s: %d bytes in %.3f s, verified (%s) in %.3f s",
                where,
                sum(len(data) for data in payload.values()),
                read_s,
                ", ".join(sorted({entry.algorithm for entry in manifest.objects.values()})),
                verify_s,
            )
            return Verified(manifest, payload)

    def latest_valid(self, newer_than: int = -1, below: int | None = None) -> Verified | None:
        """Newest snapshot above step ``newer_than`` (and below ``below``) that verifies; None if there are none,
        SnapshotError if none verifies."""
        with self.client.operation(f"cannot read snapshots under {self.client.url}"):
            listings = [
                listing
                for listing in self.list_snapshots()
                if listing.step > newer_than and (below is None or listing.step < below)
            ]
            if not listings:
                return None
            for listing in reversed(listings):
                reason = listing.problem
                if reason is None:
                    try:
                        return self.read_verified(listing.snapshot_id)
                    except SnapshotError as exc:
                        reason = str(exc)
                log.warning("skipping snapshot %s: %s", self.client.where(listing.snapshot_id), reason)
            raise SnapshotError(
                f"found {len(listings)} snapshot prefix(es) under {self.client.url} but none verifies; "
                f"nothing was deleted; point {self.client.url_key} elsewhere or remove them to start fresh"
            )

    def prune(self, keep_last: int) -> list[str]:
        """After a commit, keep the newest `keep_last` intact snapshots and delete older ones (and torn ones below them).

        Intact: committed, with every object of its manifest present at its size. A committed
        snapshot truncated later does not count toward ``keep_last``: a resume skips it, so one
        more older snapshot is kept in its place (it is left alone itself when it is newer).
        Checksums are not read here; a flipped byte is caught when a resume reads it.
        """
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        client = self.client
        with client.operation(f"cannot prune {client.url}", "check permissions of {key}"):
            listings = self.list_snapshots()
            sizes = self.object_sizes()
            committed = [
                listing
                for listing in listings
                if listing.manifest is not None
                and all(
                    sizes.get(listing.snapshot_id, {}).get(name) == entry.size
                    for name, entry in listing.manifest.objects.items()
                )
            ]
            if not committed:
                return []
            oldest_kept_step = committed[-keep_last:][0].step
            # Only prefixes below the oldest kept snapshot go, so a newer torn or in-progress
            # write is never touched: it may be the one being committed right now.
            deleted = []
            for listing in listings:
                if listing.step >= oldest_kept_step:
                    continue
                client.call("rm", client.path(listing.snapshot_id), recursive=True)
                if client.is_s3:
                    client.delete_marker(listing.snapshot_id)
                deleted.append(listing.snapshot_id)
            if client.is_s3:
                self._delete_empty_markers_below(oldest_kept_step)
            return deleted

    def _delete_empty_markers_below(self, oldest_kept_step: int) -> None:
        """Empty step-* markers left by earlier deletions (not listed as snapshots) would otherwise linger."""
        for entry in self.client.call("ls", self.client.root, detail=False, refresh=True):
            snapshot_id = entry.rstrip("/").rsplit("/", 1)[-1]
            match = SNAPSHOT_ID.match(snapshot_id)
            if match and int(match.group(1)) < oldest_kept_step:
                self.client.delete_marker(snapshot_id)
