"""Snapshot storage on any fsspec URL: payload objects first, manifest last.

A snapshot is the prefix ``<root>/step-<N>/`` holding payload objects and ``manifest.json``.
The manifest is written last and lists every object's size and sha256, so a prefix without a
manifest that parses and matches its objects does not exist for readers: a write torn by a
kill, a full disk or a lost node is never mistaken for a good snapshot.

Local files are written to a temporary name, fsynced and renamed into place. Object stores
have no rename; there the manifest being last is what keeps readers safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastictrain.errors import SnapshotError, StorageError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
MANIFEST_FORMAT = "elastictrain-snapshot"

Writer = Callable[[BinaryIO], None]  # streams one payload object into the file it is given

log = logging.getLogger("elastictrain.storage")

_SNAPSHOT_ID = re.compile(r"^step-(\d+)$")
_CHECK_STORE = "check the path/credentials or set snapshot.url"


@dataclass(frozen=True)
class ObjectEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a committed snapshot holds: its step, its objects' sizes and hashes, caller meta."""

    snapshot_id: str
    step: int  # global optimizer step the snapshot was taken at
    created_unix: float
    objects: dict[str, ObjectEntry]
    meta: dict

    def to_json(self) -> bytes:
        """Serialise to the bytes stored as manifest.json."""
        document = {
            "format": MANIFEST_FORMAT,
            "manifest_version": MANIFEST_VERSION,
            "snapshot_id": self.snapshot_id,
            "step": self.step,
            "created_unix": self.created_unix,
            "objects": {
                name: {"size": entry.size, "sha256": entry.sha256}
                for name, entry in self.objects.items()
            },
            "meta": self.meta,
        }
        return json.dumps(document, indent=2, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse manifest bytes read from `where`; SnapshotError naming `where` if unusable."""
        try:
            document = json.loads(data.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
            raise SnapshotError(f"manifest {where} is not valid JSON ({exc})") from exc
        if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
            raise SnapshotError(f"manifest {where} is not an {MANIFEST_FORMAT} manifest")
        version = document.get("manifest_version")
        if not isinstance(version, int) or version < 1:
            raise SnapshotError(f"manifest {where} has no valid manifest_version ({version!r})")
        if version > MANIFEST_VERSION:
            raise SnapshotError(
                f"manifest {where} has manifest_version {version}, this elastictrain reads up "
                f"to {MANIFEST_VERSION}; upgrade elastictrain to resume from it"
            )
        try:
            return cls(
                snapshot_id=str(document["snapshot_id"]),
                step=int(document["step"]),
                created_unix=float(document["created_unix"]),
                objects={
                    str(name): ObjectEntry(size=int(entry["size"]), sha256=str(entry["sha256"]))
                    for name, entry in document["objects"].items()
                },
                meta=dict(document["meta"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(
                f"manifest {where} lacks a field or has a malformed one ({_one_line(exc)})"
            ) from exc


@dataclass(frozen=True)
class SnapshotListing:
    """One step-* prefix under the root; `problem` says why it is unusable (None: looks fine)."""

    snapshot_id: str
    step: int
    manifest: Manifest | None
    problem: str | None


def snapshot_id_for_step(step: int) -> str:
    """Name of the snapshot taken at `step`; zero-padded so ids sort lexically as steps do."""
    return "step-%012d" % step


class _HashingWriter:
    """The file a writer is given: forwards bytes and hashes them on the way through."""

    def __init__(self, raw: BinaryIO):
        self._raw = raw
        self._sha256 = hashlib.sha256()
        self._size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._raw.write(view)
        self._sha256.update(view)
        self._size += len(view)
        return len(view)

    def flush(self) -> None:
        self._raw.flush()

    def tell(self) -> int:
        return self._size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # object stores stream uploads; writers must not seek back

    def entry(self) -> ObjectEntry:
        return ObjectEntry(size=self._size, sha256=self._sha256.hexdigest())


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


@contextmanager
def _storage_errors(action: str, advice: str = _CHECK_STORE):
    """Turn a filesystem OSError into a one-line StorageError saying what failed and what to do."""
    try:
        yield
    except OSError as exc:
        raise StorageError(f"cannot {action} ({_one_line(exc)}); {advice}") from exc


def _fsync_directory(path: str) -> None:
    # A rename or a new entry is durable only once the directory itself reaches the disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotStore:
    """Commit, list, verify and prune snapshots under one fsspec URL."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as exc:
            # fsspec names the missing package ("Install s3fs to access S3").
            raise StorageError(
                f"snapshot.url={url!r} needs a filesystem package that is not installed ({_one_line(exc)}); "
                "for s3:// run pip install 'elastictrain[s3]'"
            ) from None
        except (ValueError, TypeError) as exc:
            raise StorageError(f"snapshot.url={url!r} cannot be opened ({_one_line(exc)}); {_CHECK_STORE}") from None
        self._is_local = isinstance(self.fs, LocalFileSystem)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def _where(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])

    def check_writable(self) -> None:
        """Write, read back and delete a probe object; StorageError if the store refuses."""
        probe = self._path(f".probe-{uuid.uuid4().hex}")
        payload = f"elastictrain probe {time.time()}".encode()
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(probe, "wb") as handle:
                handle.write(payload)
            if self.fs.cat_file(probe) != payload:
                raise OSError("the probe object read back different bytes")
            self.fs.rm(probe)
        except Exception as exc:  # whatever the backend raises, the user's fix is the same
            raise StorageError(
                f"snapshot store {self.url} is not writable ({_one_line(exc)}); {_CHECK_STORE}"
            ) from exc

    def commit(self, step: int, writers: dict[str, Writer], meta: dict) -> Manifest:
        """Write every writer's object for `step`, then the manifest that makes it exist."""
        for name in writers:
            if not name or "/" in name or name.startswith(".") or name == MANIFEST_NAME:
                raise ValueError(f"snapshot object name {name!r} must be a plain file name")
        json.dumps(meta)  # meta that cannot be serialised is a bug: fail before writing anything
        snapshot_id = snapshot_id_for_step(step)
        prefix = self._path(snapshot_id)
        with _storage_errors(f"prepare snapshot {self._where(snapshot_id)}"):
            # A prefix already here is a torn leftover or an older snapshot of this step;
            # its stale objects must not survive next to the new ones.
            if self.fs.exists(prefix):
                self.fs.rm(prefix, recursive=True)
            self.fs.makedirs(prefix, exist_ok=True)
            if self._is_local:
                _fsync_directory(self.root)

        objects = {
            name: self._write_object(snapshot_id, name, writers[name]) for name in sorted(writers)
        }
        manifest = Manifest(snapshot_id, step, time.time(), objects, meta)
        manifest_bytes = manifest.to_json()
        self._write_object(snapshot_id, MANIFEST_NAME, lambda handle: handle.write(manifest_bytes))
        return manifest

    def _write_object(self, snapshot_id: str, name: str, writer: Writer) -> ObjectEntry:
        path = self._path(snapshot_id, name)
        action = f"write object '{name}' of snapshot {self._where(snapshot_id)}"
        with _storage_errors(action, "check free space and permissions of snapshot.url"):
            if self._is_local:
                return self._write_local_atomically(path, writer)
            with self.fs.open(path, "wb") as raw:
                hashing = _HashingWriter(raw)
                writer(hashing)
            return hashing.entry()

    def _write_local_atomically(self, path: str, writer: Writer) -> ObjectEntry:
        directory, name = os.path.split(path)
        fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as raw:
                hashing = _HashingWriter(raw)
                writer(hashing)
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(temp_path, path)
        except BaseException:
            # Never leave a half-written temp file behind, whatever interrupted the writer.
            try:
                os.unlink(temp_path)
            except FileNotFoundError:
                pass
            raise
        _fsync_directory(directory)
        return hashing.entry()

    def list_snapshots(self) -> list[SnapshotListing]:
        """List step-* prefixes oldest first, each with its manifest or why it has none (cheap)."""
        self.fs.invalidate_cache(self.root)  # object-store listings are cached; we need the truth
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            message = f"cannot list {self.url} ({_one_line(exc)}); {_CHECK_STORE}"
            raise StorageError(message) from exc
        listings = []
        for entry in entries:
            snapshot_id = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _SNAPSHOT_ID.match(snapshot_id)
            if entry.get("type") != "directory" or match is None:
                continue
            try:
                manifest = self._read_manifest(snapshot_id)
                problem = None if manifest else "no manifest (torn or in-progress write)"
            except SnapshotError as exc:
                manifest, problem = None, f"manifest unreadable: {exc}"
            listings.append(SnapshotListing(snapshot_id, int(match.group(1)), manifest, problem))
        return sorted(listings, key=lambda listing: listing.step)

    def _read_object(self, snapshot_id: str, name: str) -> bytes | None:
        """Bytes of one object, None if it does not exist; StorageError if the store fails."""
        try:
            return self.fs.cat_file(self._path(snapshot_id, name))
        except FileNotFoundError:
            return None
        except OSError as exc:
            where = self._where(snapshot_id, name)
            raise StorageError(f"cannot read {where} ({_one_line(exc)}); {_CHECK_STORE}") from exc

    def _read_manifest(self, snapshot_id: str) -> Manifest | None:
        """Parse one snapshot's manifest; None if it has none, SnapshotError if it is unusable."""
        data = self._read_object(snapshot_id, MANIFEST_NAME)
        if data is None:
            return None
        where = self._where(snapshot_id, MANIFEST_NAME)
        manifest = Manifest.from_json(data, where)
        if manifest.snapshot_id != snapshot_id:  # e.g. copied by hand into the wrong prefix
            raise SnapshotError(f"manifest {where} belongs to snapshot {manifest.snapshot_id!r}")
        return manifest

    def read_verified(self, snapshot_id: str) -> tuple[Manifest, dict[str, bytes]]:
        """Read a snapshot, checking each object's size and sha256; SnapshotError if one differs."""
        corrupt = f"snapshot {self._where(snapshot_id)} is corrupt"
        try:
            manifest = self._read_manifest(snapshot_id)
        except SnapshotError as exc:
            raise SnapshotError(f"{corrupt}: {exc}") from exc
        if manifest is None:
            raise SnapshotError(f"{corrupt}: it has no {MANIFEST_NAME}")
        payload = {}
        for name, expected in sorted(manifest.objects.items()):
            data = self._read_object(snapshot_id, name)
            if data is None:
                raise SnapshotError(f"{corrupt}: object '{name}' is missing")
            if len(data) != expected.size:
                raise SnapshotError(f"{corrupt}: object '{name}' size mismatch "
                                    f"(manifest says {expected.size} bytes, found {len(data)})")
            actual_sha256 = hashlib.sha256(data).hexdigest()
            if actual_sha256 != expected.sha256:
                raise SnapshotError(f"{corrupt}: object '{name}' sha256 mismatch "
                                    f"(manifest says {expected.sha256}, found {actual_sha256})")
            payload[name] = data
        return manifest, payload

    def latest_valid(self) -> tuple[Manifest, dict[str, bytes]] | None:
        """Newest snapshot that verifies; None if there are none, SnapshotError if none verifies."""
        listings = self.list_snapshots()
        if not listings:
            return None
        for listing in reversed(listings):
            reason = listing.problem
            if reason is None:
                try:
                    return self.read_verified(listing.snapshot_id)
                except SnapshotError as exc:
                    reason = str(exc)
            log.warning("skipping snapshot %s: %s", self._where(listing.snapshot_id), reason)
        raise SnapshotError(
            f"found {len(listings)} snapshot prefix(es) under {self.url} but none verifies; "
            "nothing was deleted; point snapshot.url elsewhere or remove them to start fresh"
        )

    def prune(self, keep_last: int) -> list[str]:
        """After a commit, keep the newest `keep_last` committed snapshots and delete older ones."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        listings = self.list_snapshots()
        committed = [listing for listing in listings if listing.manifest is not None]
        if not committed:
            return []
        oldest_kept_step = committed[-keep_last:][0].step
        # Only prefixes below the oldest kept snapshot go, so a newer torn or in-progress
        # write is never touched: it may be the one being committed right now.
        deleted = []
        for listing in listings:
            if listing.step >= oldest_kept_step:
                continue
            where = self._where(listing.snapshot_id)
            with _storage_errors(f"delete {where}", "check permissions of snapshot.url"):
                self.fs.rm(self._path(listing.snapshot_id), recursive=True)
            deleted.append(listing.snapshot_id)
        return deleted
