"""Committing a snapshot: payload objects first, checksummed as they stream, the manifest last.

The manifest is written last and lists every object's size and checksum (computed while the
bytes stream through; ``manifest.py`` says which algorithm), so a prefix without a manifest that
parses and matches its objects does not exist for readers: a write torn by a kill, a full disk or
a lost node is never mistaken for a good snapshot. A commit that fails while this process lives
removes its own torn prefix (best effort, never another prefix); one torn by a kill is skipped by
readers and deleted by a later ``prune`` once it is older than the oldest snapshot kept.

On a local disk a commit removes any prefix of its step, creates it afresh and writes each
payload object straight under its final name: until the manifest exists the prefix is torn for
every reader, so a half-written object needs no temporary name. Every payload file is fsynced
(on a helper thread, while the next object is written; the commit waits for all of them and
fails if one fails), then the prefix's directory once (the payload's entries); only then is the
manifest written to a temporary name, fsynced, renamed into place, and the directory fsynced
again. A crash at any point leaves either a prefix without a manifest (skipped by readers,
deleted by a later prune) or a complete snapshot; earlier snapshots are never touched. Object
stores have no rename: there the manifest is PUT only after every payload object's PUT
returned, and its being last is what keeps readers safe.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, cast

from elastictrain.core.errors import StorageError
from elastictrain.storage.catalog import Catalog
from elastictrain.storage.hashing import CommitTimings, CountingSink, HashingWriter
from elastictrain.storage.manifest import MANIFEST_NAME, Manifest, ObjectEntry, snapshot_id_for_step
from elastictrain.storage.store_client import StoreClient
from elastictrain.storage.store_errors import is_disk_full, is_unavailable, one_line

Writer = Callable[[BinaryIO], object]  # streams one payload object into the file it is given

log = logging.getLogger("elastictrain.storage.snapshot_store")

_CLEANUP_ATTEMPT_S = 5.0


def _fsync_directory(path: str) -> None:
    # A rename or a new entry is durable only once the directory itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_close(raw: BinaryIO) -> None:
    try:
        os.fsync(raw.fileno())
    finally:
        raw.close()


def write_local_atomically(path: str, writer: Writer, timings: CommitTimings | None = None) -> ObjectEntry:
    """Write a local file under a temporary name in its directory, fsync it, rename it into place, fsync the directory."""
    timings = timings or CommitTimings()
    directory, name = os.path.split(path)
    fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            hashing = HashingWriter(raw, timings)
            hashing.run(writer)
            raw.flush()
            syncing = time.perf_counter()
            os.fsync(raw.fileno())
            timings.fsync_s += time.perf_counter() - syncing
        os.replace(temp_path, path)
    except BaseException:
        # Never leave a half-written temp file behind, whatever interrupted the writer.
        try:
            os.unlink(temp_path)
        except FileNotFoundError:
            pass
        raise
    syncing = time.perf_counter()
    _fsync_directory(directory)
    timings.fsync_s += time.perf_counter() - syncing
    return hashing.entry()


def write_small_object(client: StoreClient, name: str, data: bytes) -> None:
    """Replace one small object at the store's root in one step (the lease, the run id): atomically on a local disk."""
    if client.is_local:
        client.call("makedirs", client.root, exist_ok=True)
        write_local_atomically(client.path(name), lambda handle: handle.write(data))
    else:
        client.call("pipe_file", client.path(name), data)


class Committer:
    """Writes snapshots into one store; ``last_timings`` says where the last commit's time went.

    ``recycle_keep_last`` (local filesystems; the fast tier sets it to its keep-last): once that
    many snapshots are committed, and at least two, a commit takes over the oldest one, which the
    prune after it would delete, and writes over its files in place. Its manifest goes first, so
    from then on it is a torn prefix for every reader, and the others stay valid throughout. On
    tmpfs a 50 MB object written over an old file took 8 ms against 23 ms into a new one: the
    kernel need not allocate, zero and later free the pages.
    """

    def __init__(self, client: StoreClient, catalog: Catalog, recycle_keep_last: int = 0) -> None:
        self.client = client
        self.catalog = catalog
        self.recycle_keep_last = recycle_keep_last
        self.last_timings: CommitTimings | None = None

    def commit(
        self,
        step: int,
        writers: dict[str, Writer],
        meta: dict,
        written: dict[str, ObjectEntry] | None = None,
        recycle: bool = True,
    ) -> Manifest:
        """Write every writer's object for `step`, then the manifest that makes it exist, listing ``written`` too
        (objects the ranks already wrote under the prefix: a sharded snapshot's, sharded.py). ``recycle``: False
        leaves every older snapshot as it is (a fresh prefix, whatever ``recycle_keep_last`` says)."""
        for name in writers:
            if not name or "/" in name or name.startswith(".") or name == MANIFEST_NAME:
                raise ValueError(f"snapshot object name {name!r} must be a plain file name")
        json.dumps(meta)  # meta that cannot be serialised is a bug: fail before writing anything
        client = self.client
        snapshot_id = snapshot_id_for_step(step)
        prefix = client.path(snapshot_id)
        where = client.where(snapshot_id)
        started = time.perf_counter()
        timings = CommitTimings()
        with client.operation(f"snapshot {where} could not be written", "check free space and permissions of {key}"):
            # A prefix already here is a torn leftover or an older snapshot of this step; its
            # stale objects must not survive next to the new ones. (A listing, not a HEAD: a
            # refused credential then says so instead of a bare 403.)
            if not written and client.call("find", prefix):  # (``written``: the prefix was cleared before them)
                client.call("rm", prefix, recursive=True)
            if client.is_local:
                if not (recycle and self.recycle_keep_last and self._recycle_oldest(prefix, writers)):
                    client.call("makedirs", prefix, exist_ok=True)
                syncing = time.perf_counter()
                _fsync_directory(client.root)
                timings.fsync_s += time.perf_counter() - syncing
            try:
                if client.is_local:
                    objects = self._write_local_payload(snapshot_id, writers, timings)
                else:
                    objects = {
                        name: self._write_object(snapshot_id, name, writers[name], timings) for name in sorted(writers)
                    }
                objects = {**(written or {}), **objects}
                manifest = Manifest(snapshot_id, step, time.time(), objects, meta)
                manifest_bytes = manifest.to_json()
                manifest_started = time.perf_counter()
                self._write_object(
                    snapshot_id, MANIFEST_NAME, lambda handle: handle.write(manifest_bytes), CommitTimings()
                )
                timings.manifest_s = time.perf_counter() - manifest_started
                timings.total_s = time.perf_counter() - started
                timings.size_bytes = sum(entry.size for entry in objects.values())
                self.last_timings = timings
                return manifest
            except BaseException as exc:
                self._remove_torn(snapshot_id, exc)
                if client.is_local and is_disk_full(exc):
                    raise self._disk_full_error(where, writers) from None
                raise

    def _recycle_oldest(self, prefix: str, writers: dict[str, Writer]) -> bool:
        """Make the oldest committed snapshot the torn prefix ``prefix``, its files kept for overwriting (see the class)."""
        committed = [listing for listing in self.catalog.list_snapshots() if listing.manifest is not None]
        if len(committed) < max(self.recycle_keep_last, 2):
            return False
        victim = self.client.path(committed[0].snapshot_id)
        os.unlink(os.path.join(victim, MANIFEST_NAME))  # not a snapshot for any reader from here on
        for name in set(os.listdir(victim)) - set(writers):
            os.unlink(os.path.join(victim, name))
        _fsync_directory(victim)
        os.rename(victim, prefix)
        return True

    def _write_local_payload(
        self, snapshot_id: str, writers: dict[str, Writer], timings: CommitTimings
    ) -> dict[str, ObjectEntry]:
        """Write each payload object under its final name in the prefix; all durable when this returns.

        No temporary name and no rename: the prefix has no manifest yet, so readers treat whatever
        is in it as torn. A file already there (a recycled snapshot's) is written over in place and
        cut to the new size. Each file is fsynced on a helper thread while the next one is written
        (fsync waits on the disk, not on the GIL); all fsyncs are joined, a failed one failing the
        commit, and then the directory is fsynced once. ``timings.fsync_s`` counts only the time
        this thread waits for them.
        """
        objects = {}
        # Leaving the with-block waits for every fsync still running, also when a writer raised,
        # so no file of this prefix is still open when the commit's cleanup deletes it.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastictrain-fsync") as syncer:
            syncs = []
            for name in sorted(writers):
                path = self.client.path(snapshot_id, name)
                # "x": a fresh prefix was just emptied; "r+": a recycled one's file, written over in place
                raw = open(path, "r+b" if self.recycle_keep_last and os.path.exists(path) else "xb")
                try:
                    hashing = HashingWriter(raw, timings)
                    hashing.run(writers[name])
                    raw.truncate()
                    raw.flush()
                except BaseException:
                    raw.close()
                    raise
                syncs.append(syncer.submit(_fsync_and_close, raw))
                objects[name] = hashing.entry()
            syncing = time.perf_counter()
            for sync in syncs:
                sync.result()  # an fsync's error (EIO, ENOSPC) is raised here and fails the commit
        _fsync_directory(self.client.path(snapshot_id))  # the payload's directory entries, before the manifest's
        timings.fsync_s += time.perf_counter() - syncing
        return objects

    def _write_object(self, snapshot_id: str, name: str, writer: Writer, timings: CommitTimings) -> ObjectEntry:
        path = self.client.path(snapshot_id, name)
        if self.client.is_local:
            return write_local_atomically(path, writer, timings)
        if self.client.is_async:
            return self._upload_staged(path, name, writer, timings)
        with self.client.fs.open(path, "wb") as raw:  # in-process filesystems (memory://): nothing to retry
            hashing = HashingWriter(raw, timings)
            hashing.run(writer)
        return hashing.entry()

    def _upload_staged(self, path: str, name: str, writer: Writer, timings: CommitTimings) -> ObjectEntry:
        """Run the writer once into a local staging file, then upload it (retried without re-running the writer)."""
        with tempfile.NamedTemporaryFile(prefix=f"elastictrain-{name}-", suffix=".staged") as staged:
            try:
                hashing = HashingWriter(staged, timings)
                hashing.run(writer)
                staged.flush()
            except OSError as exc:
                raise StorageError(
                    f"cannot stage object '{name}' in {tempfile.gettempdir()} before uploading it to {self.client.url} "
                    f"({one_line(exc)}); set TMPDIR to a local disk with space"
                ) from None
            entry = hashing.entry()
            uploading = time.perf_counter()
            self.client.call("put_file", staged.name, path, upload_bytes=entry.size)
            timings.upload_s += time.perf_counter() - uploading
        return entry

    def _remove_torn(self, snapshot_id: str, cause: BaseException) -> None:
        """Best effort, after a failed commit: delete this commit's own prefix, nothing else."""
        client = self.client
        where = client.where(snapshot_id)
        if is_unavailable(cause):
            # Cleaning up would wait on the same silent store; readers skip the prefix and prune deletes it.
            log.warning("snapshot %s was not committed; its partial objects stay until a later prune", where)
            return
        try:
            limit_s = min(_CLEANUP_ATTEMPT_S, client.attempt_limit_s or _CLEANUP_ATTEMPT_S)
            if client.attempt("exists", client.path(snapshot_id), limit_s=limit_s):
                client.attempt("rm", client.path(snapshot_id), recursive=True, limit_s=limit_s)
            if client.is_s3:
                client.delete_marker(snapshot_id, limit_s=limit_s)
        except Exception as exc:  # the commit's own error is what the caller needs to see
            log.warning(
                "could not remove the partial snapshot %s (%s); a later prune deletes it",
                where,
                client.scrub(one_line(exc)),
            )

    def _disk_full_error(self, where: str, writers: dict[str, Writer]) -> StorageError:
        needed = 0
        for writer in writers.values():  # only on this path: how much the snapshot would have needed
            sink = CountingSink()
            writer(cast(BinaryIO, sink))  # a file that counts: the calls a writer makes, nothing stored
            needed += sink.size
        existing = self.client.root
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        free = shutil.disk_usage(existing).free
        return StorageError(
            f"snapshot {where} could not be written: the device is full (needed ~{needed} bytes, {free} bytes free); "
            f"free space or point {self.client.url_key} elsewhere — earlier snapshots are intact"
        )
