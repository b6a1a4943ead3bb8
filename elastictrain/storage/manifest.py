"""What a committed snapshot is: its id, and the manifest (written last) that lists its objects.

A snapshot is the prefix ``<root>/step-<N>/``; its ``manifest.json`` names every payload object
with its size and checksum. Only a prefix whose manifest parses and matches its objects exists.

Checksums. The manifest records each object's checksum algorithm next to its digest: xxh3_128
(xxHash's 128-bit XXH3, ~27 GB/s here against sha256's ~1.4 GB/s, which made hashing most of a
commit's time). It guards against torn, truncated and corrupted bytes, not against a forger:
what keeps a crafted file from running code is ``torch.load``'s ``weights_only``. A manifest
naming an algorithm this version does not know is refused with one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from elastictrain.core.errors import SnapshotError, one_line
from elastictrain.storage.mapped import ObjectData

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 2
MANIFEST_FORMAT = "elastictrain-snapshot"

SNAPSHOT_ID = re.compile(r"^step-(\d+)$")

# Algorithm name (as the manifest records it) -> a new hasher with update() and hexdigest().
CHECKSUMS: dict[str, Callable[..., Any]] = {"xxh3_128": xxhash.xxh3_128}  # name -> hasher(optional first bytes)
CHECKSUM = "xxh3_128"  # what new snapshots record


@dataclass(frozen=True)
class ObjectEntry:
    size: int
    algorithm: str  # a key of CHECKSUMS
    digest: str  # hex


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
                name: {"size": entry.size, "algorithm": entry.algorithm, "digest": entry.digest}
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
            manifest = cls(
                snapshot_id=str(document["snapshot_id"]),
                step=int(document["step"]),
                created_unix=float(document["created_unix"]),
                objects={
                    str(name): ObjectEntry(
                        size=int(entry["size"]), algorithm=str(entry["algorithm"]), digest=str(entry["digest"])
                    )
                    for name, entry in document["objects"].items()
                },
                meta=dict(document["meta"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(
                f"manifest {where} lacks a field or has a malformed one ({one_line(exc, kind=True)})"
            ) from exc
        for name, entry in sorted(manifest.objects.items()):
            if entry.algorithm not in CHECKSUMS:
                raise SnapshotError(
                    f"manifest {where} checks object '{name}' with {entry.algorithm!r}, which this elastictrain does "
                    f"not know (it knows {', '.join(sorted(CHECKSUMS))}); upgrade elastictrain to resume from it"
                )
        return manifest


class Verified(NamedTuple):
    """A snapshot read back whole: its manifest and every object's bytes, each checked against the manifest (a
    local store's as ``MappedFile``: mapped.py)."""

    manifest: Manifest
    objects: dict[str, ObjectData]


@dataclass(frozen=True)
class SnapshotListing:
    """One step-* prefix under the root; `problem` says why it is unusable (None: looks fine)."""

    snapshot_id: str
    step: int
    manifest: Manifest | None
    problem: str | None


def snapshot_id_for_step(step: int) -> str:
    """Name of the snapshot taken at `step`; zero-padded so ids sort lexically as steps do."""
    return f"step-{step:012d}"
