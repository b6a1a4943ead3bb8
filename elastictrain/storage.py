"""Snapshot storage on any fsspec URL: payload objects first, manifest last.

A snapshot is the prefix ``<root>/step-<N>/`` holding payload objects and ``manifest.json``.
The manifest is written last and lists every object's size and checksum (computed while the
bytes stream through; ``manifest.py`` says which algorithms), so a prefix without a manifest that
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
stores have no rename; there the manifest being last is what keeps readers safe. What the
protocol relies on from an object store, and nothing more:

- single-key read-after-write: a reader that GETs the manifest sees the object that was PUT
  (S3 has been strongly consistent for this since December 2020; SeaweedFS and MinIO are too);
- the manifest is PUT only after every payload object's PUT returned;
- listing is used only to discover candidate prefixes: every candidate is verified by reading
  its manifest and then every object's bytes, so a listing that lags or shows a stale prefix
  cannot make a bad snapshot look good. Prefixes that hold no object (the "directory" markers
  some stores, e.g. SeaweedFS, keep after their objects are deleted) are not candidates, and
  ``prune`` deletes the marker too.

Errors. Every public method raises only ``StorageError`` (one line: what failed, where, what to
do; secrets from ``storage_options`` never appear) or, for a store that does not answer,
``StorageUnavailable``; our own bugs (TypeError, ValueError on bad arguments) keep their
traceback. "Does not answer" is: connection refused or reset, connect/read timeouts, an attempt
exceeding its time limit, HTTP 5xx, SlowDown/throttling. Such a call is retried with tenacity
(exponential backoff with jitter, 0.2 s doubling up to 4 s, never sleeping past the deadline)
until ``retry_for_s`` seconds have passed since the public call began (one budget per
operation, shared by all its store calls); then it raises ``StorageUnavailable``. Anything else
(missing bucket, refused credentials, permission denied, disk full) is not retried.

Bounded time on s3://. Unless ``storage_options`` sets them, the S3 client gets
``config_kwargs={"connect_timeout": min(5, retry_for_s), "read_timeout": min(20, retry_for_s),
"retries": {"total_max_attempts": 1}}`` and s3fs's own retry loop is set to one attempt, so
tenacity is the only retry layer. Every attempt also has a hard limit of connect_timeout +
read_timeout seconds, plus one second per MiB it uploads (an upload slower than 1 MiB/s counts
as a store that does not answer): aiohttp waits without any timeout for the "100 Continue" of a
PUT to a server that accepted the connection but stopped answering. So an unreachable or hung
endpoint fails any operation within about retry_for_s + one attempt's limit (45 s with the
defaults; connection refused fails within retry_for_s). Payload objects are staged (in memory
up to 8 MiB, else in a temporary file under TMPDIR) and then uploaded, so a retry never
re-runs a writer.

Credentials come from ``storage_options`` (``key``/``secret``/``token``, endpoint as
``endpoint_url`` or ``client_kwargs.endpoint_url``) or, as botocore reads them, from the
``AWS_*`` environment variables and config files.

The store lease (``acquire_lease``) keeps two runs from writing one store; see its docstring
for what it does and does not guarantee.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import fsspec
import fsspec.asyn
import tenacity
from fsspec.implementations.local import LocalFileSystem

from elastictrain.config import REDACTED
from elastictrain.manifest import (  # noqa: F401  (re-exported: the store's public names)
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    SNAPSHOT_ID,
    Manifest,
    ObjectEntry,
    SnapshotListing,
    snapshot_id_for_step,
)
from elastictrain.store_errors import (  # noqa: F401
    CREDENTIAL_CODES,
    S3_CONNECT_TIMEOUT_S,
    S3_READ_TIMEOUT_S,
    causes,
    is_disk_full,
    is_storage_failure,
    is_unavailable,
    one_line,
    s3_error,
    s3_options_with_bounded_time,
    secret_values,
)
from elastictrain.errors import (
    ElastictrainError,
    SnapshotError,
    StorageError,
    StorageUnavailable,
    StoreLeaseError,
)

LEASE_NAME = ".lease.json"
RUN_ID_NAME = ".run-id"  # the run this store belongs to: node-local copies are kept under it (snapshotter.py)

Writer = Callable[[BinaryIO], None]  # streams one payload object into the file it is given

log = logging.getLogger("elastictrain.storage")

_CHECK_STORE = "check the path/credentials or set {key}"

_MIN_UPLOAD_BYTES_PER_S = 1 << 20  # slower than this, an upload attempt counts as not answering
_STAGE_IN_MEMORY_BYTES = 8 << 20
_BACKOFF_INITIAL_S, _BACKOFF_MAX_S = 0.2, 4.0
_CLEANUP_ATTEMPT_S = 5.0


@dataclass
class CommitTimings:
    """Where one commit's time went, in seconds (wall time on the committing thread).

    ``serialise_s`` is the writers' own time (torch.save pickling, between the bytes it hands
    over); ``write_s`` the time in the destination's write calls (the page cache, or the staging
    file before an upload); ``hash_s`` the checksum; ``fsync_s`` waiting for payload files and the
    directory to reach the disk (a local payload file's fsync runs on a helper thread while the
    next object is written; only what is left of it when the last object is written counts);
    ``upload_s`` the object-store PUTs; ``manifest_s`` writing the manifest (its fsync and rename
    included). Prune is not part of a commit.
    """

    serialise_s: float = 0.0
    hash_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    upload_s: float = 0.0
    manifest_s: float = 0.0
    total_s: float = 0.0
    size_bytes: int = 0


class _HashingWriter:
    """The file a writer is given: forwards bytes and checksums them on the way through, with no copy.

    The checksum is computed inline: xxh3 costs ~9 ms per 200 MB. Hashing on a helper thread
    while this one wrote was tried and lost on the shared 2-core machine (median 287 against
    242 ms per 205 MB commit, 15 interleaved pairs): the helper competes with the write for a core.
    """

    def __init__(self, raw: BinaryIO, algorithm: str, timings: CommitTimings):
        self._raw = raw
        self._algorithm = algorithm
        self._hasher = CHECKSUMS[algorithm]()
        self._size = 0
        self._timings = timings

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        started = time.perf_counter()
        self._raw.write(view)
        written = time.perf_counter()
        self._hasher.update(view)
        self._timings.write_s += written - started
        self._timings.hash_s += time.perf_counter() - written
        self._size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def tell(self) -> int:
        return self._size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # object stores stream uploads; writers must not seek back

    def entry(self) -> ObjectEntry:
        return ObjectEntry(size=self._size, algorithm=self._algorithm, digest=self._hasher.hexdigest())

    def run(self, writer: Writer) -> None:
        """Run ``writer`` into this file, counting the time it spends outside write() as serialisation."""
        before = self._timings.write_s + self._timings.hash_s
        started = time.perf_counter()
        writer(self)
        in_writes = self._timings.write_s + self._timings.hash_s - before
        self._timings.serialise_s += time.perf_counter() - started - in_writes


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


class _CountingSink:
    """A file that only counts what is written: the size a writer needs, without the space."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.size += size
        return size

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it is just not ours
    return True


class SnapshotStore:
    """Commit, list, verify and prune snapshots under one fsspec URL; hold the store's lease.

    ``checksum`` is the algorithm new snapshots record (a key of ``CHECKSUMS``); reading verifies
    each object with the algorithm its manifest names. ``last_commit_timings`` says where the last
    commit's time went.

    ``recycle_keep_last`` (local filesystems; the fast tier sets it to its keep-last): once that
    many snapshots are committed, and at least two, a commit takes over the oldest one, which the
    prune after it would delete, and writes over its files in place. Its manifest goes first, so
    from then on it is a torn prefix for every reader, and the others stay valid throughout. On
    tmpfs a 50 MB object written over an old file took 8 ms against 23 ms into a new one: the
    kernel need not allocate, zero and later free the pages.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, retry_for_s: float = 20.0,
                 checksum: str = DEFAULT_CHECKSUM, recycle_keep_last: int = 0, url_key: str = "snapshot.durable.url"):
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {sorted(CHECKSUMS)}, got {checksum!r}")
        self.recycle_keep_last = recycle_keep_last
        self.url = url
        self.url_key = url_key  # the config key that set the URL: messages tell the user to change that one
        self.retry_for_s = float(retry_for_s)
        self.checksum = checksum
        self.last_commit_timings: CommitTimings | None = None
        self._secrets = secret_values(storage_options or {})
        self._is_s3 = url.split("://", 1)[0].lower() in ("s3", "s3a") if "://" in url else False
        options = s3_options_with_bounded_time(storage_options, self.retry_for_s) if self._is_s3 else dict(storage_options or {})
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            # fsspec names the missing package ("Install s3fs to access S3").
            raise StorageError(
                f"{url_key}={url!r} needs a filesystem package that is not installed ({self._scrub(one_line(exc))}); "
                "for s3:// run pip install 'elastictrain[s3]'"
            ) from None
        except (ValueError, TypeError) as exc:
            raise StorageError(f"{url_key}={url!r} cannot be opened ({self._scrub(one_line(exc))}); "
                               f"{_CHECK_STORE.format(key=url_key)}") from None
        self._is_local = isinstance(self.fs, LocalFileSystem)
        self._is_async = isinstance(self.fs, fsspec.asyn.AsyncFileSystem)
        self._attempt_limit_s: float | None = None
        if self._is_s3:
            self.fs.retries = 1  # s3fs's own retry loop: one attempt; tenacity retries instead
            config = options["config_kwargs"]
            self._attempt_limit_s = float(config["connect_timeout"]) + float(config["read_timeout"])
            self._bucket, _, self._key_prefix = self.root.strip("/").partition("/")
        self._endpoint = self._scrub(str(
            options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"
        ))
        self._operation_state = threading.local()  # the deadline of the public call running in this thread
        self._lease: dict | None = None
        self._lease_stale_after_s = 0.0

    # -- paths and messages ---------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def _where(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])

    def _scrub(self, text: str) -> str:
        for secret in getattr(self, "_secrets", ()):
            text = text.replace(secret, REDACTED)
        return text

    # -- calling the store: one budget per public call, retries, one-line errors ------------------

    @contextmanager
    def _operation(self, failure: str, advice: str = _CHECK_STORE) -> Iterator[None]:
        """The boundary of a public method: a retry budget of retry_for_s, and one-line errors out.

        ``failure`` says what went wrong in the user's words ("snapshot store X is not writable").
        Errors of the store or the network become StorageError/StorageUnavailable; anything else
        (a bug in our code or the caller's) passes unchanged. A nested public call shares the
        outer call's budget and boundary.
        """
        state = self._operation_state
        if getattr(state, "deadline", None) is not None:
            yield
            return
        state.started = time.monotonic()
        state.deadline = state.started + self.retry_for_s
        try:
            yield
        except ElastictrainError:
            raise
        except Exception as exc:
            if not is_storage_failure(exc):
                raise
            raise self._translate(exc, failure, advice.format(key=self.url_key), time.monotonic() - state.started) from None
        finally:
            state.deadline = None

    def _translate(self, exc: BaseException, failure: str, advice: str, elapsed_s: float) -> StorageError:
        code, status = s3_error(exc)
        detail = one_line(exc)
        if is_unavailable(exc):
            message = (
                f"{failure}: the store did not answer for {elapsed_s:.1f} s (retried with backoff for up to "
                f"snapshot.durable.retry_for_s={self.retry_for_s:g} s; last error {detail}); check that {self._endpoint_words()} "
                "is up and reachable; it may come back"
            )
            return StorageUnavailable(self._scrub(message))
        if code == "NoSuchBucket":
            return StorageError(self._scrub(self._missing_bucket_message()))
        if code in CREDENTIAL_CODES:
            message = (
                f"{failure}: {self._endpoint_words()} refused the credentials ({code}); check key/secret in "
                "snapshot.durable.storage_options or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
            return StorageError(self._scrub(message))
        if code in ("AccessDenied", "403") or (self._is_s3 and status == 403):
            message = (
                f"{failure}: {self._endpoint_words()} refused access ({code or status}): the credentials are wrong or "
                "lack permission on this bucket; check key/secret in snapshot.durable.storage_options or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy"
            )
            return StorageError(self._scrub(message))
        if any(type(item).__name__ in ("NoCredentialsError", "PartialCredentialsError") for item in causes(exc)):
            message = (
                f"{failure}: no S3 credentials found; set key/secret in snapshot.durable.storage_options or "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
            return StorageError(self._scrub(message))
        return StorageError(self._scrub(f"{failure} ({detail}); {advice}"))

    def _endpoint_words(self) -> str:
        return f"the endpoint {self._endpoint}" if self._is_s3 else f"the filesystem of {self.url}"

    def _missing_bucket_message(self) -> str:
        return (
            f"bucket '{self._bucket}' does not exist at endpoint {self._endpoint}; create it or fix snapshot.durable.url "
            f"(now {self.url})"
        )

    def _attempt(self, method: str, *args: Any, limit_s: float | None, **kwargs: Any) -> Any:
        """One call of an fsspec method; on an async filesystem, cancelled after limit_s seconds."""
        if self._is_async:
            coroutine_function = getattr(self.fs, "_" + method)
            return fsspec.asyn.sync(self.fs.loop, coroutine_function, *args, timeout=limit_s, **kwargs)
        return getattr(self.fs, method)(*args, **kwargs)

    def _call(self, method: str, *args: Any, upload_bytes: int = 0, **kwargs: Any) -> Any:
        """A store call, retried with backoff while the store does not answer, until this operation's deadline."""
        deadline = getattr(self._operation_state, "deadline", None) or time.monotonic() + self.retry_for_s
        limit_s = None
        if self._attempt_limit_s is not None:
            limit_s = self._attempt_limit_s + upload_bytes / _MIN_UPLOAD_BYTES_PER_S
        backoff = tenacity.wait_exponential(multiplier=_BACKOFF_INITIAL_S, max=_BACKOFF_MAX_S) + tenacity.wait_random(0, _BACKOFF_INITIAL_S)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_unavailable),
            stop=lambda retry_state: time.monotonic() >= deadline,
            wait=lambda retry_state: max(0.0, min(backoff(retry_state), deadline - time.monotonic())),
            before_sleep=lambda retry_state: log.debug(
                "%s on %s did not answer (attempt %d: %s); retrying", method, self.url, retry_state.attempt_number,
                self._scrub(one_line(retry_state.outcome.exception())),
            ),
            reraise=True,
        )
        return retrying(self._attempt, method, *args, limit_s=limit_s, **kwargs)

    def _check_bucket(self) -> None:
        """S3 only: StorageError naming the bucket if it does not exist (s3fs would create it, SeaweedFS accepts PUTs)."""
        try:
            self._call("call_s3", "list_objects_v2", Bucket=self._bucket, Prefix=self._key_prefix, MaxKeys=1)
        except FileNotFoundError as exc:
            if s3_error(exc)[0] in ("NoSuchBucket", "404", ""):
                raise StorageError(self._scrub(self._missing_bucket_message())) from None
            raise

    # -- writing --------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Write, read back and delete a probe object; StorageError if the store refuses, within bounded time."""
        probe = self._path(f".probe-{uuid.uuid4().hex}")
        payload = f"elastictrain probe {time.time()}".encode()
        with self._operation(f"snapshot store {self.url} is not writable"):
            if self._is_s3:
                self._check_bucket()  # never makedirs: on s3fs that creates a misspelt bucket
            else:
                self._call("makedirs", self.root, exist_ok=True)
            self._call("pipe_file", probe, payload)
            if self._call("cat_file", probe) != payload:
                raise StorageError(f"snapshot store {self.url} is not writable: the probe object read back different bytes")
            self._call("rm", probe)

    def commit(self, step: int, writers: dict[str, Writer], meta: dict) -> Manifest:
        """Write every writer's object for `step`, then the manifest that makes it exist."""
        for name in writers:
            if not name or "/" in name or name.startswith(".") or name == MANIFEST_NAME:
                raise ValueError(f"snapshot object name {name!r} must be a plain file name")
        json.dumps(meta)  # meta that cannot be serialised is a bug: fail before writing anything
        snapshot_id = snapshot_id_for_step(step)
        prefix = self._path(snapshot_id)
        where = self._where(snapshot_id)
        started = time.perf_counter()
        timings = CommitTimings()
        with self._operation(f"snapshot {where} could not be written", "check free space and permissions of {key}"):
            # A prefix already here is a torn leftover or an older snapshot of this step; its
            # stale objects must not survive next to the new ones. (A listing, not a HEAD: a
            # refused credential then says so instead of a bare 403.)
            if self._call("find", prefix):
                self._call("rm", prefix, recursive=True)
            if self._is_local:
                if not (self.recycle_keep_last and self._recycle_oldest(prefix, writers)):
                    self._call("makedirs", prefix, exist_ok=True)
                syncing = time.perf_counter()
                _fsync_directory(self.root)
                timings.fsync_s += time.perf_counter() - syncing
            try:
                if self._is_local:
                    objects = self._write_local_payload(snapshot_id, writers, timings)
                else:
                    objects = {name: self._write_object(snapshot_id, name, writers[name], timings) for name in sorted(writers)}
                manifest = Manifest(snapshot_id, step, time.time(), objects, meta)
                manifest_bytes = manifest.to_json()
                manifest_started = time.perf_counter()
                self._write_object(snapshot_id, MANIFEST_NAME, lambda handle: handle.write(manifest_bytes), CommitTimings())
                timings.manifest_s = time.perf_counter() - manifest_started
                timings.total_s = time.perf_counter() - started
                timings.size_bytes = sum(entry.size for entry in objects.values())
                self.last_commit_timings = timings
                return manifest
            except BaseException as exc:
                self._remove_torn(snapshot_id, exc)
                if self._is_local and is_disk_full(exc):
                    raise self._disk_full_error(where, writers) from None
                raise

    def _recycle_oldest(self, prefix: str, writers: dict[str, Writer]) -> bool:
        """Make the oldest committed snapshot the torn prefix ``prefix``, its files kept for overwriting (see the class)."""
        committed = [listing for listing in self.list_snapshots() if listing.manifest is not None]
        if len(committed) < max(self.recycle_keep_last, 2):
            return False
        victim = self._path(committed[0].snapshot_id)
        os.unlink(os.path.join(victim, MANIFEST_NAME))  # not a snapshot for any reader from here on
        for name in set(os.listdir(victim)) - set(writers):
            os.unlink(os.path.join(victim, name))
        _fsync_directory(victim)
        os.rename(victim, prefix)
        return True

    def _write_local_payload(self, snapshot_id: str, writers: dict[str, Writer], timings: CommitTimings) -> dict[str, ObjectEntry]:
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
                path = self._path(snapshot_id, name)
                # "x": a fresh prefix was just emptied; "r+": a recycled one's file, written over in place
                raw = open(path, "r+b" if self.recycle_keep_last and os.path.exists(path) else "xb")
                try:
                    hashing = _HashingWriter(raw, self.checksum, timings)
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
        _fsync_directory(self._path(snapshot_id))  # the payload's directory entries, before the manifest's
        timings.fsync_s += time.perf_counter() - syncing
        return objects

    def _write_object(self, snapshot_id: str, name: str, writer: Writer, timings: CommitTimings) -> ObjectEntry:
        path = self._path(snapshot_id, name)
        if self._is_local:
            return self._write_local_atomically(path, writer, timings)
        if self._is_async:
            return self._upload_staged(path, name, writer, timings)
        with self.fs.open(path, "wb") as raw:  # in-process filesystems (memory://): nothing to retry
            hashing = _HashingWriter(raw, self.checksum, timings)
            hashing.run(writer)
        return hashing.entry()

    def _upload_staged(self, path: str, name: str, writer: Writer, timings: CommitTimings) -> ObjectEntry:
        """Run the writer once into a local staging file, then upload it (retried without re-running the writer)."""
        with tempfile.NamedTemporaryFile(prefix=f"elastictrain-{name}-", suffix=".staged") as staged:
            try:
                hashing = _HashingWriter(staged, self.checksum, timings)
                hashing.run(writer)
                staged.flush()
            except OSError as exc:
                raise StorageError(
                    f"cannot stage object '{name}' in {tempfile.gettempdir()} before uploading it to {self.url} "
                    f"({one_line(exc)}); set TMPDIR to a local disk with space"
                ) from None
            entry = hashing.entry()
            uploading = time.perf_counter()
            self._call("put_file", staged.name, path, upload_bytes=entry.size)
            timings.upload_s += time.perf_counter() - uploading
        return entry

    def _write_local_atomically(self, path: str, writer: Writer, timings: CommitTimings | None = None) -> ObjectEntry:
        timings = timings or CommitTimings()
        directory, name = os.path.split(path)
        fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as raw:
                hashing = _HashingWriter(raw, self.checksum, timings)
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

    def _remove_torn(self, snapshot_id: str, cause: BaseException) -> None:
        """Best effort, after a failed commit: delete this commit's own prefix, nothing else."""
        where = self._where(snapshot_id)
        if is_unavailable(cause):
            # Cleaning up would wait on the same silent store; readers skip the prefix and prune deletes it.
            log.warning("snapshot %s was not committed; its partial objects stay until a later prune", where)
            return
        try:
            limit_s = min(_CLEANUP_ATTEMPT_S, self._attempt_limit_s or _CLEANUP_ATTEMPT_S)
            if self._attempt("exists", self._path(snapshot_id), limit_s=limit_s):
                self._attempt("rm", self._path(snapshot_id), recursive=True, limit_s=limit_s)
            if self._is_s3:
                self._delete_marker(snapshot_id, limit_s=limit_s)
        except Exception as exc:  # the commit's own error is what the caller needs to see
            log.warning("could not remove the partial snapshot %s (%s); a later prune deletes it",
                        where, self._scrub(one_line(exc)))

    def _delete_marker(self, snapshot_id: str, limit_s: float | None = None) -> None:
        # Some stores (SeaweedFS) keep an emptied prefix as a "directory" that listings still show.
        key = "/".join(filter(None, [self._key_prefix.strip("/"), snapshot_id])) + "/"
        try:
            if limit_s is None:
                self._call("call_s3", "delete_object", Bucket=self._bucket, Key=key)
            else:
                self._attempt("call_s3", "delete_object", Bucket=self._bucket, Key=key, limit_s=limit_s)
        except FileNotFoundError:
            pass

    def _disk_full_error(self, where: str, writers: dict[str, Writer]) -> StorageError:
        needed = 0
        for writer in writers.values():  # only on this path: how much the snapshot would have needed
            sink = _CountingSink()
            writer(sink)
            needed += sink.size
        existing = self.root
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        free = shutil.disk_usage(existing).free
        return StorageError(
            f"snapshot {where} could not be written: the device is full (needed ~{needed} bytes, {free} bytes free); "
            f"free space or point {self.url_key} elsewhere — earlier snapshots are intact"
        )

    # -- reading --------------------------------------------------------------------------------

    def list_snapshots(self) -> list[SnapshotListing]:
        """List step-* prefixes holding at least one object, oldest first, each with its manifest or why it has none."""
        with self._operation(f"cannot list {self.url}"):
            object_counts = self._objects_by_snapshot()
            listings = []
            for snapshot_id in object_counts:
                try:
                    manifest = self._read_manifest(snapshot_id)
                    problem = None if manifest else "no manifest (torn or in-progress write)"
                except SnapshotError as exc:
                    manifest, problem = None, f"manifest unreadable: {exc}"
                step = int(SNAPSHOT_ID.match(snapshot_id).group(1))
                listings.append(SnapshotListing(snapshot_id, step, manifest, problem))
            return sorted(listings, key=lambda listing: listing.step)

    def _objects_by_snapshot(self) -> dict[str, int]:
        """step-* id -> number of objects under it; prefixes without objects (empty markers) are absent."""
        return {snapshot_id: len(sizes) for snapshot_id, sizes in self._object_sizes().items()}

    def _object_sizes(self) -> dict[str, dict[str, int]]:
        """step-* id -> {object name: size in bytes}, from one listing; prefixes without objects are absent."""
        self.fs.invalidate_cache(self.root)  # object-store listings are cached; we need the truth
        try:
            found = self._call("find", self.root, withdirs=False, detail=True)
        except FileNotFoundError:
            found = {}
        if not found and self._is_s3:
            self._check_bucket()  # an empty listing of a missing bucket is a mistake, not a fresh store
        root = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        sizes: dict[str, dict[str, int]] = {}
        for path, info in found.items():
            path = self.fs._strip_protocol(path)
            if not path.startswith(root):
                continue
            snapshot_id, sep, rest = path[len(root):].partition("/")
            if sep and rest and SNAPSHOT_ID.match(snapshot_id):
                sizes.setdefault(snapshot_id, {})[rest] = info.get("size")
        return sizes

    def _read_object(self, snapshot_id: str, name: str) -> bytes | None:
        """Bytes of one object, None if it does not exist."""
        try:
            return self._call("cat_file", self._path(snapshot_id, name))
        except FileNotFoundError:
            return None

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
        """Read a snapshot, checking each object's size and checksum; SnapshotError if one differs."""
        corrupt = f"snapshot {self._where(snapshot_id)} is corrupt"
        read_s = verify_s = 0.0
        with self._operation(f"cannot read {self._where(snapshot_id)}"):
            try:
                manifest = self._read_manifest(snapshot_id)
            except SnapshotError as exc:
                raise SnapshotError(f"{corrupt}: {exc}") from exc
            if manifest is None:
                raise SnapshotError(f"{corrupt}: it has no {MANIFEST_NAME}")
            payload = {}
            for name, expected in sorted(manifest.objects.items()):
                started = time.perf_counter()
                data = self._read_object(snapshot_id, name)
                read_s += time.perf_counter() - started
                if data is None:
                    raise SnapshotError(f"{corrupt}: object '{name}' is missing")
                if len(data) != expected.size:
                    raise SnapshotError(f"{corrupt}: object '{name}' size mismatch "
                                        f"(manifest says {expected.size} bytes, found {len(data)})")
                started = time.perf_counter()
                actual = CHECKSUMS[expected.algorithm](data).hexdigest()
                verify_s += time.perf_counter() - started
                if actual != expected.digest:
                    raise SnapshotError(f"{corrupt}: object '{name}' {expected.algorithm} mismatch "
                                        f"(manifest says {expected.digest}, found {actual})")
                payload[name] = data
            log.info("read snapshot %s: %d bytes in %.3f s, verified (%s) in %.3f s", self._where(snapshot_id),
                     sum(len(data) for data in payload.values()), read_s,
                     ", ".join(sorted({entry.algorithm for entry in manifest.objects.values()})), verify_s)
            return manifest, payload

    def latest_valid(self, newer_than: int = -1) -> tuple[Manifest, dict[str, bytes]] | None:
        """Newest snapshot above step ``newer_than`` that verifies; None if there are none, SnapshotError if none verifies."""
        with self._operation(f"cannot read snapshots under {self.url}"):
            listings = [listing for listing in self.list_snapshots() if listing.step > newer_than]
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
                f"nothing was deleted; point {self.url_key} elsewhere or remove them to start fresh"
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
        with self._operation(f"cannot prune {self.url}", "check permissions of {key}"):
            listings = self.list_snapshots()
            sizes = self._object_sizes()
            committed = [listing for listing in listings if listing.manifest is not None and all(
                sizes.get(listing.snapshot_id, {}).get(name) == entry.size
                for name, entry in listing.manifest.objects.items())]
            if not committed:
                return []
            oldest_kept_step = committed[-keep_last:][0].step
            # Only prefixes below the oldest kept snapshot go, so a newer torn or in-progress
            # write is never touched: it may be the one being committed right now.
            deleted = []
            for listing in listings:
                if listing.step >= oldest_kept_step:
                    continue
                self._call("rm", self._path(listing.snapshot_id), recursive=True)
                if self._is_s3:
                    self._delete_marker(listing.snapshot_id)
                deleted.append(listing.snapshot_id)
            if self._is_s3:
                self._delete_empty_markers_below(oldest_kept_step)
            return deleted

    def _delete_empty_markers_below(self, oldest_kept_step: int) -> None:
        """Empty step-* markers left by earlier deletions (not listed as snapshots) would otherwise linger."""
        for entry in self._call("ls", self.root, detail=False, refresh=True):
            snapshot_id = entry.rstrip("/").rsplit("/", 1)[-1]
            match = SNAPSHOT_ID.match(snapshot_id)
            if match and int(match.group(1)) < oldest_kept_step:
                self._delete_marker(snapshot_id)

    # -- the run's identity -----------------------------------------------------------------------

    def run_id(self) -> str:
        """The id of the run this store belongs to: created by its first start (before any snapshot), then read back.

        A node-local copy is kept under it, so a copy is restored only into the run whose durable
        store it belongs to: not into a run that reuses the name with another (or an emptied) store.
        """
        with self._operation(f"cannot read or write the run id of snapshot store {self.url}"):
            try:
                found = self._call("cat_file", self._path(RUN_ID_NAME)).decode("utf-8", "replace").strip()
            except FileNotFoundError:
                found = None
            if found is not None and len(found) == 32 and all(c in "0123456789abcdef" for c in found):
                return found
            if found is not None:  # another id would only disown this run's node-local copies, never adopt others'
                log.warning("the run id %s is unreadable; this run gets a new one", self._where(RUN_ID_NAME))
            run_id = uuid.uuid4().hex
            data = run_id.encode()
            if self._is_local:
                self._call("makedirs", self.root, exist_ok=True)
                self._write_local_atomically(self._path(RUN_ID_NAME), lambda handle: handle.write(data))
            else:
                self._call("pipe_file", self._path(RUN_ID_NAME), data)
            return run_id

    # -- the store lease ------------------------------------------------------------------------

    def acquire_lease(self, owner: dict, stale_after_s: float) -> None:
        """Take the store's lease for this run, or raise StoreLeaseError naming the live run that holds it.

        ``owner`` has ``run_id``, ``token`` (shared by every attempt of one job), ``host``, ``pid``
        and ``started_unix``; the lease object ``<root>/.lease.json`` adds ``renewed_unix``.
        Taken if there is none, if it carries the same token (this job, restarted), or if it is
        stale: renewed more than ``stale_after_s`` ago, or held by a process on this host that is
        gone. ``stale_after_s == 0`` disables the lease (acquire, renew and release do nothing).

        Guarantees, and their limits: the other run's lease is never modified or deleted unless
        stale. Timestamps are the writer's wall clock (``time.time()``), so hosts whose clocks
        differ by more than a fraction of ``stale_after_s`` can misjudge staleness. The store has
        no compare-and-swap here: two runs starting within one round trip of each other can both
        write; the read-back after the write makes the later writer win and the earlier one see
        a foreign token and raise, which narrows but does not close that window.
        """
        missing = {"run_id", "token", "host", "pid", "started_unix"} - set(owner)
        if missing:
            raise ValueError(f"lease owner lacks {sorted(missing)}")
        if stale_after_s <= 0:
            self._lease = None
            return
        with self._operation(f"cannot take the lease of snapshot store {self.url}"):
            current = self._read_lease()
            if current is not None and current.get("token") != owner["token"]:
                stale_because = self._stale_because(current, stale_after_s)
                if stale_because is None:
                    raise StoreLeaseError(self._lease_held_message(current, stale_after_s))
                log.warning("taking over the stale lease of snapshot store %s from run %s (%s)",
                            self.url, current.get("run_id"), stale_because)
            record = {name: owner[name] for name in ("run_id", "token", "host", "pid", "started_unix")}
            record["renewed_unix"] = time.time()
            self._write_lease(record)
            written = self._read_lease()
            if written is None or written.get("token") != record["token"]:
                raise StoreLeaseError(self._lease_held_message(written or {}, stale_after_s, lost_race=True))
            self._lease, self._lease_stale_after_s = record, float(stale_after_s)

    def renew_lease(self) -> None:
        """Refresh ``renewed_unix`` of the lease this store holds; StoreLeaseError if another run took it over."""
        if self._lease is None:
            return
        with self._operation(f"cannot renew the lease of snapshot store {self.url}"):
            current = self._read_lease()
            if current is not None and current.get("token") != self._lease["token"]:
                raise StoreLeaseError(
                    f"the lease of snapshot store {self.url} was taken over by run {current.get('run_id')} "
                    f"(host {current.get('host')}, pid {current.get('pid')}) after this run's lease went stale; "
                    "this run must stop writing snapshots there"
                )
            record = {**self._lease, "renewed_unix": time.time()}
            self._write_lease(record)
            self._lease = record

    def release_lease(self) -> None:
        """Delete the lease if this run still holds it; another run's lease is left alone."""
        if self._lease is None:
            return
        token, self._lease = self._lease["token"], None
        with self._operation(f"cannot release the lease of snapshot store {self.url}"):
            current = self._read_lease()
            if current is not None and current.get("token") == token:
                self._call("rm", self._path(LEASE_NAME))

    def _read_lease(self) -> dict | None:
        try:
            data = self._call("cat_file", self._path(LEASE_NAME))
        except FileNotFoundError:
            return None
        try:
            record = json.loads(data.decode("utf-8"))
        except ValueError:
            record = None
        if not isinstance(record, dict):
            log.warning("the lease object %s is unreadable; treating it as stale", self._where(LEASE_NAME))
            return {"run_id": "unknown (unreadable lease)", "renewed_unix": 0.0}
        return record

    def _write_lease(self, record: dict) -> None:
        data = json.dumps(record, sort_keys=True).encode("utf-8")
        if self._is_local:
            self._call("makedirs", self.root, exist_ok=True)
            self._write_local_atomically(self._path(LEASE_NAME), lambda handle: handle.write(data))
        else:
            self._call("pipe_file", self._path(LEASE_NAME), data)

    @staticmethod
    def _stale_because(record: dict, stale_after_s: float) -> str | None:
        try:
            age_s = time.time() - float(record.get("renewed_unix", 0.0))
        except (TypeError, ValueError):
            return "its renewal time is unreadable"
        if age_s > stale_after_s:
            return f"last renewed {age_s:.0f} s ago, stale after {stale_after_s:g} s"
        pid = record.get("pid")
        if record.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            return f"its process {pid} on this host is gone"
        return None

    def _lease_held_message(self, record: dict, stale_after_s: float, lost_race: bool = False) -> str:
        try:
            age = f"{time.time() - float(record.get('renewed_unix')):.0f} s ago"
        except (TypeError, ValueError):
            age = "at an unknown time"
        how = "took it at the same moment" if lost_race else "holds it"
        return self._scrub(
            f"snapshot store {self.url} is in use: run {record.get('run_id')} (host {record.get('host')}, "
            f"pid {record.get('pid')}, last renewed {age}) {how}, and two runs must not write one store; wait for "
            f"it to finish (its lease goes stale {stale_after_s:g} s after its last renewal), use another "
            "snapshot.durable.url, or set snapshot.durable.lease_stale_after_s=0 to disable the lease"
        )
