"""Each rank's slot in node memory: what a survivor copy needs of every rank, per step (``survivor.py``).

A rank writes its slot in every step (``StepSlots.write``); a survivor reads its node's slots when a peer is lost,
and a restore reads them for a survivor copy written on another node (``InSlots``): that copy holds the model and
the state of its own node's ranks, and names the others, whose state is in their own nodes' slots. Restoring it
is chosen only where every named rank's slot still holds that very step (``choose_partial``, pure).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastictrain.core.rng import rng_from_compact
from elastictrain.dist.collectives import all_gather
from elastictrain.storage.hashing import checksum_bytes, mismatch
from elastictrain.storage.manifest import CHECKSUM, ObjectEntry

_DIGEST = len(checksum_bytes(b"").digest)  # the payload's checksum: storage/hashing.py's, as every snapshot object's
_HEADER = struct.Struct(f"<QQ{_DIGEST}s")  # sequence number, payload length, its checksum (hex)
SLOT_DIR = ".survivor-slots"  # under the fast tier's directory of the run
if TYPE_CHECKING:
    from elastictrain.dist.group import DistContext

_SLOT_FILE = re.compile(r"rank-(\d+)\.[ab]$")

SlotKey = tuple[int, int, str]  # (step, metric records, rendezvous round): what a slot's record goes with


def slot_dir(root: str) -> str:
    """The slots' directory under the fast tier's directory of the run (``root``)."""
    return os.path.join(root, SLOT_DIR)


def key_of(record: dict[str, Any]) -> SlotKey:
    """The (step, metric records, round) a slot's record goes with."""
    return record["step"], record["records"], record["round"]


def rank_state_of(record: dict[str, Any]) -> dict[str, Any]:
    """A slot's record as a snapshot holds a rank's state: ``{"rng": ..., <rank stateful>: ...}``."""
    return {"rng": rng_from_compact(record["rng"]), **record["rank_state"]}


class StepSlots:
    """Each rank's slot in node memory: two alternating files, so a write torn by a kill leaves the other one."""

    def __init__(self, directory: str, rank: int, local_rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self.local_rank = local_rank
        self._fds: list[int] = []
        self._alive_fd: int | None = None
        self._sequence = 0

    def open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        # Held until this process ends, for whatever reason: the kernel releases it on SIGKILL too.
        self._alive_fd = os.open(self._alive_path(self.local_rank), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._alive_fd, fcntl.LOCK_EX)
        self._fds = [os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for path in self._paths(self.rank)]

    def close(self) -> None:
        for fd in [*self._fds, *([self._alive_fd] if self._alive_fd is not None else [])]:
            os.close(fd)
        self._fds, self._alive_fd = [], None

    def write(self, record: dict[str, Any]) -> None:
        payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        self._sequence += 1
        entry = checksum_bytes(payload)
        header = _HEADER.pack(self._sequence, entry.size, entry.digest.encode())
        os.pwritev(self._fds[self._sequence % 2], (header, payload), 0)  # one call, the payload not copied again

    def read(self, rank: int, want: tuple[int, int, str] | None = None) -> dict[str, Any] | None:
        """The intact record of ``rank``'s slot naming ``want`` (step, metric records, round) if either of its two
        does, else the newest intact one, or None."""
        records = self.records(rank)
        matching = [r for r in records if want is not None and key_of(r) == want]
        found = matching or records
        return found[0] if found else None

    def records(self, rank: int) -> list[dict[str, Any]]:
        """The intact records of ``rank``'s slot, newest first (two, one after a torn write, none if never written)."""
        found: list[tuple[int, dict[str, Any]]] = []
        for path in self._paths(rank):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if len(data) < _HEADER.size:
                continue
            sequence, length, digest = _HEADER.unpack_from(data)
            payload = data[_HEADER.size : _HEADER.size + length]
            if mismatch(ObjectEntry(length, CHECKSUM, digest.decode("ascii", "replace")), checksum_bytes(payload)):
                continue  # torn by a kill in the middle of its write
            found.append((sequence, pickle.loads(payload)))
        return [record for _, record in sorted(found, key=lambda item: item[0], reverse=True)]

    def lowest_alive(self) -> bool:
        """No lower local rank is still running (its lock is free: it died, or it never started)."""
        for local_rank in range(self.local_rank):
            try:
                fd = os.open(self._alive_path(local_rank), os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            finally:
                os.close(fd)  # closing releases the lock just taken
        return True

    def _paths(self, rank: int) -> list[str]:
        return [os.path.join(self.directory, f"rank-{rank}.{part}") for part in "ab"]

    def _alive_path(self, local_rank: int) -> str:
        return os.path.join(self.directory, f"alive-local-rank-{local_rank}")


@dataclass(frozen=True)
class InSlots:
    """A survivor copy written where not every rank's slot was (a job across nodes): the ranks whose state it lacks
    and the key their slots' records must carry (its manifest's ``in_slots``)."""

    step: int
    ranks: tuple[int, ...]
    key: SlotKey

    def to_meta(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "key": list(self.key)}

    @classmethod
    def from_meta(cls, step: int, meta: dict[str, Any]) -> InSlots | None:
        found = meta.get("in_slots")
        if not found:
            return None
        step_, records, round_id = found["key"]
        return cls(step, tuple(found["ranks"]), (int(step_), int(records), str(round_id)))


def node_keys(directory: str) -> dict[int, list[SlotKey]]:
    """The keys of the intact records in a node's slots, by rank ({} where there are none)."""
    slots = StepSlots(directory, rank=-1, local_rank=-1)
    try:
        ranks = sorted({int(m.group(1)) for name in os.listdir(directory) if (m := _SLOT_FILE.match(name))})
    except OSError:
        return {}
    return {rank: [key_of(r) for r in slots.records(rank)] for rank in ranks}


def choose_partial(partials: list[InSlots | None], keys: list[dict[int, list[SlotKey]]], newer_than: int) -> int | None:
    """The rank whose survivor copy to restore (``partials``: what each rank offers; ``keys``: every rank's
    ``node_keys``): the newest copy above step ``newer_than`` whose every named rank some node's slot still holds at
    the copy's key; None."""
    held: dict[int, set[SlotKey]] = {}
    for node in keys:
        for rank, found in node.items():
            held.setdefault(rank, set()).update(found)
    best: int | None = None
    for holder, partial in enumerate(partials):
        if partial is None or partial.step <= newer_than:
            continue
        if all(partial.key in held.get(rank, set()) for rank in partial.ranks):
            if best is None or partial.step > (partials[best] or partial).step:
                best = holder
    return best


def states_in(directory: str, partial: InSlots) -> dict[int, dict[str, Any]]:
    """The state of each rank ``partial`` names that a node's slots hold at its key (``rank_state_of``)."""
    slots = StepSlots(directory, rank=-1, local_rank=-1)
    found = {}
    for rank in partial.ranks:
        record = slots.read(rank, want=partial.key)
        if record is not None and key_of(record) == partial.key:
            found[rank] = rank_state_of(record)
    return found


def gather_states(root: str, is_writer: bool, ctx: DistContext, partial: InSlots) -> dict[int, dict[str, Any]]:
    """Every rank: the state of each rank ``partial`` names, read from its node's slots by that node's writer
    (``root``: the fast tier's directory of the run) and sent to every rank; ``choose_partial`` chose the copy
    because every one of them is there."""
    states: dict[int, dict[str, Any]] = {}
    for node_states in all_gather(states_in(slot_dir(root), partial) if is_writer else {}, ctx):
        for rank, state in node_states.items():
            states.setdefault(rank, state)
    missing = set(partial.ranks) - set(states)
    assert not missing, f"survivor slots of rank(s) {sorted(missing)} vanished between choosing and reading them"
    return states
