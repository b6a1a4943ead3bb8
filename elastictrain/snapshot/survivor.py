"""Survivor copies: when a worker dies inside a step, a survivor on its node writes the step before it.

Under DDP every rank holds the same model, optimizer and progress, and none of them changes
between the start of a step and its optimizer step: forward and backward only make gradients.
What differs per rank is small: its RNG state, its stream position (streams only) and its
metric values since the last reduce (the copy holds them per rank, as a snapshot does). So each
rank leaves those in a slot of its own in node memory in every step, and again after every metric
reduce (``StepSlots``, about 11 KB and 13 us), with the step and the length of the metric
history they go with. A step is marked before its last backward: from there on nothing per rank
changes within the step (backward and the optimizer step draw no random numbers and read no
data), and that backward's gradient all-reduce is what lets the peers finish the step, so no peer
can be past the step a dead rank's slot names. Each slot keeps its record before too: a survivor
whose all-reduce broke is still at the step before, and finds it there.

When a peer dies, the survivors' collective fails: in the step's gradient all-reduce, or in a
metric reduce or a vote between steps. A survivor whose metric history has the length its step's
records name, on every slot, writes a fast-tier copy of that step from its live model and the
slots (``SurvivorCopies.write``). The restart then redoes only the step that was cut short,
instead of everything since the last timed copy (Gupta et al., "Just-In-Time Checkpointing",
EuroSys '24, do the same from the healthy data-parallel replicas). Marked after the all-reduce
instead, a rank killed between its last gradient sent and its mark left the survivors a step
ahead of its slot: 2 of 17 kills of ``benchmarks/goodput.py``'s job, each re-doing ~100 steps.

When no copy is written, and the restart reads the newest timed copy as before:

- the failure came outside training (a snapshot, an evaluation);
- any slot holds no record of the survivor's step, history length and rendezvous round (the dead
  rank died in the middle of a metric reduce), or is missing;
- the ranks are not all on this node (each node sees only its own slots), or the model has
  floating-point buffers (BatchNorm statistics change in the forward pass and differ per rank);
- a lower local rank is still alive: it writes the copy (the lowest live one does; liveness is an
  ``flock`` each rank holds on its own file while it runs, released by the kernel when it dies).

It imports nothing of the loop: the loop calls ``mark`` in every step and after every metric
reduce, and ``write`` when a peer is lost.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any

import torch

from elastictrain.core.progress import History, Progress
from elastictrain.core.rng import capture_rng_compact, rng_from_compact
from elastictrain.snapshot.local_tier import LocalTier
from elastictrain.storage.hashing import checksum_bytes, mismatch
from elastictrain.storage.manifest import CHECKSUM, ObjectEntry

log = logging.getLogger("elastictrain")

_DIGEST = len(checksum_bytes(b"").digest)  # the payload's checksum: storage/hashing.py's, as every snapshot object's
_HEADER = struct.Struct(f"<QQ{_DIGEST}s")  # sequence number, payload length, its checksum (hex)
_SLOT_DIR = ".survivor-slots"


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
        os.pwrite(self._fds[self._sequence % 2], header + payload, 0)

    def read(self, rank: int, want: tuple[int, int, str] | None = None) -> dict[str, Any] | None:
        """The intact record of ``rank``'s slot naming ``want`` (step, metric records, round) if either of its two
        does, else the newest intact one, or None."""
        records = self.records(rank)
        matching = [r for r in records if want is not None and (r["step"], r["records"], r["round"]) == want]
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


class SurvivorCopies:
    """Marks each step's per-rank state on every rank; after a peer is lost, writes that step's fast copy."""

    def __init__(
        self,
        fast: LocalTier,
        world_size: int,
        round_id: str,
        progress: Progress,
        history: History,
        rank_state: Callable[[], dict[str, Any] | None],
    ) -> None:
        self.fast = fast
        self.progress = progress  # replicated: the step every slot must name
        self.history = history  # replicated: the metric sums in the slots go with this many records
        self.world_size = world_size
        self.round_id = round_id
        self.rank_state = rank_state  # this rank's stream positions and metric sums (None: not readable at every step)
        ctx = fast.ctx
        self.slots = StepSlots(os.path.join(fast.store.root, _SLOT_DIR), ctx.rank, ctx.env.local_rank)  # see open

    @staticmethod
    def applies(
        fast: LocalTier | None, model: torch.nn.Module, world_size: int, local_world_size: int | None
    ) -> str | None:
        """None when survivor copies can work here, else why not (logged once by the caller)."""
        if fast is None:
            return "there is no fast tier (snapshot.local.url)"
        if world_size < 2:
            return "a single worker has no survivor"
        if fast.sharded is not None:
            return "dist.strategy=fsdp: the dead rank's shards are gone with it; the restart reads the newest copy"
        if local_world_size is None:
            return "the launcher does not say how many ranks share this node (torchrun's LOCAL_WORLD_SIZE)"
        if local_world_size != world_size:
            return "the ranks are not all on one node (each node sees only its own ranks' slots)"
        if any(buffer.is_floating_point() for buffer in model.buffers()):
            return "the model has floating-point buffers (BatchNorm statistics change in the forward pass)"
        return None

    def open(self) -> None:
        # After RESTORE: the fast tier's directory is then this run's own (LocalTier.join_run).
        self.slots.directory = os.path.join(self.fast.store.root, _SLOT_DIR)
        self.slots.open()

    def close(self) -> None:
        self.slots.close()

    def mark(self, device: torch.device, step: int | None = None) -> None:
        """This rank's part of a copy of ``step`` (default: the current one), before its next collective.

        Written before a step's last backward (``step`` is then the one that step completes: nothing
        per rank changes in between), and after a metric reduce.
        """
        self.slots.write(
            {
                "step": self.progress.global_step if step is None else step,
                "records": len(self.history.records),
                "round": self.round_id,
                "rng": capture_rng_compact(device),
                "rank_state": self.rank_state(),
            }
        )

    def write(self, complete: Callable[[], None], meta: dict[str, Any]) -> int | None:
        """A peer was lost while training: write this step's copy if this rank is the node's lowest survivor and
        every slot agrees with its progress and history; returns the step written.

        ``complete`` records what a snapshot of this step would hold besides the state.
        """
        step, live = self.progress.global_step, (self.progress.global_step, len(self.history.records), self.round_id)
        own = self.slots.read(self.slots.rank, want=live)
        if own is None or (own["step"], own["records"], own["round"]) != live:
            log.info(
                "no survivor copy: this rank is at step %d with %d metric records, its slot at %s",
                step,
                live[1],
                (own["step"], own["records"]) if own else None,
            )
            return None
        if not self.slots.lowest_alive():
            return None  # a lower local rank survived: it writes
        records = [
            own if rank == self.slots.rank else self.slots.read(rank, want=live) for rank in range(self.world_size)
        ]
        others = {rank: (r["step"], r["records"], r["round"]) if r else None for rank, r in enumerate(records)}
        differ = {rank: seen for rank, seen in others.items() if seen != live}
        if differ:
            log.info(
                "no survivor copy of step %d: the slots of rank(s) %s name %s (step, metric records, round) "
                "instead; the restart reads the newest fast copy",
                step,
                ",".join(map(str, differ)),
                ", ".join(str(seen[:2]) if seen else "nothing" for seen in differ.values()),
            )
            return None
        if any(r is None or r["rank_state"] is None for r in records):
            log.info(
                "no survivor copy of step %d: the metric sums on %s are not read at every step; the restart "
                "reads the newest fast copy",
                step,
                self.fast.ctx.device.type,
            )
            return None
        complete()
        rank_states = [{"rng": rng_from_compact(r["rng"]), **r["rank_state"]} for r in records if r is not None]
        report = self.fast.save_survivor(step, rank_states, {**meta, "survivor": True})
        if report is None:
            log.info("no survivor copy needed: the fast tier already holds step %d", step)
            return step
        if not report.committed:
            return None  # _commit said why in a warning
        log.warning(
            "survivor copy of step %d written to %s in %.3f s: the restart redoes only the step that was cut short",
            step,
            self.fast.url,
            report.duration_s,
        )
        return step
