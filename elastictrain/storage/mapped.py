"""A local snapshot object mapped into memory instead of read: no allocation, no copy, until its tensors load.

Reading an object into ``bytes`` allocates its size and copies it out of the page cache, and ``torch.load``
of those bytes allocates and copies every tensor once more: on this machine each costs ~0.5 s per GB, most of
it the kernel handing out fresh pages. A mapped object is checksummed straight from the page cache (a node's
fast tier is tmpfs: the file *is* node memory), and ``torch.load(mmap=True)`` maps the same open file again
through ``/proc/self/fd``, so what loads is the file the checksum read even if its path is renamed or
unlinked in between (``format.load_object`` then copies each tensor out once).

A file is never written in place while a restore maps it: commits write a fresh prefix or recycle the
*oldest* committed copy (``commit.py``), a restore reads the newest, and every writer of the run is stopped
while it restores. A writer cutting a mapped file short would make the next read of its pages a SIGBUS.
"""

from __future__ import annotations

import mmap
import os

_FD_LINKS = "/proc/self/fd"  # Linux: a path that opens an already open file again


class MappedFile(mmap.mmap):
    """A read-only map of a whole file, holding the file open; ``path`` opens that very file again."""

    path: str
    _fd: int = -1  # open as long as the map lives: ``path`` names it

    def __eq__(self, other: object) -> bool:
        """Equal to any bytes-like object of the same contents, as the ``bytes`` a remote store returns would be."""
        try:
            with memoryview(self) as mine, memoryview(other) as theirs:  # type: ignore[arg-type]
                return mine == theirs
        except TypeError:
            return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a bytearray's: equal by contents, never a key

    def forget_pages(self) -> None:
        """Take the pages read so far out of this process's resident set; they stay in the page cache (tmpfs: in
        the file itself), and a later read maps them again. Once verified, an object is loaded through ``path``
        by torch.load's own map: resident in both maps it would count twice in RSS, though no memory is new."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        super().close()
        self._release()

    def __del__(self) -> None:
        self._release()

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


ObjectData = bytes | memoryview | MappedFile  # an object's contents as a store reads them (or a broadcast hands them)


def map_file(path: str) -> MappedFile | bytes:
    """``path``'s contents as a ``MappedFile``; ``bytes`` read as usual where no map can be made (an empty file,
    a system without ``/proc/self/fd``). FileNotFoundError and other OSErrors pass through."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not os.path.isdir(_FD_LINKS) or os.fstat(fd).st_size == 0:
            with os.fdopen(fd, "rb") as handle:
                fd = -1  # the handle closes it
                return handle.read()
        mapped = MappedFile(fd, 0, access=mmap.ACCESS_READ)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    mapped._fd, mapped.path = fd, f"{_FD_LINKS}/{fd}"
    return mapped
