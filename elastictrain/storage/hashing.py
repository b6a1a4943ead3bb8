"""Payload checksums, the one place they are computed and compared against a manifest entry.

``HashingWriter`` checksums bytes as a writer streams them (a commit); ``checksum_bytes`` and
``checksum_stream`` checksum bytes in memory or read back from a file (DCP's shards, a node's
copy); ``mismatch`` says why what was found is not what a manifest recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, BinaryIO, cast

from elastictrain.storage.manifest import CHECKSUM, CHECKSUMS, ObjectEntry
from elastictrain.storage.mapped import ObjectData

_CHUNK = 8 << 20  # bytes read at a time when checksumming a file


def checksum_bytes(data: ObjectData, algorithm: str = CHECKSUM) -> ObjectEntry:
    """The size and checksum of ``data``."""
    return ObjectEntry(size=memoryview(data).nbytes, algorithm=algorithm, digest=CHECKSUMS[algorithm](data).hexdigest())


def checksum_stream(handle: BinaryIO, algorithm: str = CHECKSUM) -> ObjectEntry:
    """The size and checksum of what is left to read from ``handle``, read in chunks (OSError passes through)."""
    hasher, size = CHECKSUMS[algorithm](), 0
    while chunk := handle.read(_CHUNK):
        hasher.update(chunk)
        size += len(chunk)
    return ObjectEntry(size=size, algorithm=algorithm, digest=hasher.hexdigest())


def mismatch(expected: ObjectEntry, found: ObjectEntry) -> str | None:
    """Why ``found`` is not the object a manifest recorded as ``expected`` (size first, then checksum), or None."""
    if found.size != expected.size:
        return f"size mismatch (manifest says {expected.size} bytes, found {found.size})"
    if found.digest != expected.digest:
        return f"{expected.algorithm} mismatch (manifest says {expected.digest}, found {found.digest})"
    return None


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


class HashingWriter:
    """The file a writer is given: forwards bytes and checksums them on the way through, with no copy.

    The checksum is computed inline: xxh3 costs ~9 ms per 200 MB. Hashing on a helper thread
    while this one wrote was tried and lost on the shared 2-core machine (median 287 against
    242 ms per 205 MB commit, 15 interleaved pairs): the helper competes with the write for a core.
    """

    def __init__(self, raw: IO[bytes], timings: CommitTimings):
        self._raw = raw
        self._hasher = CHECKSUMS[CHECKSUM]()
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
        return ObjectEntry(size=self._size, algorithm=CHECKSUM, digest=self._hasher.hexdigest())

    def run(self, writer: Callable[[BinaryIO], object]) -> None:
        """Run ``writer`` into this file, counting the time it spends outside write() as serialisation."""
        before = self._timings.write_s + self._timings.hash_s
        started = time.perf_counter()
        writer(cast(BinaryIO, self))  # write/flush/tell/writable/seekable: what torch.save and the writers call
        in_writes = self._timings.write_s + self._timings.hash_s - before
        self._timings.serialise_s += time.perf_counter() - started - in_writes


class CountingSink:
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
