"""Corrupting a snapshot's file on disk the way the tests do: one byte in its middle flipped, size unchanged."""

from __future__ import annotations

from pathlib import Path


def flip_middle_byte(path: Path) -> None:
    """Flip every bit of the byte in the middle of ``path``: its checksum no longer matches, its size still does."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
