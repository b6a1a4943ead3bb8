"""Sharded snapshots (``dist.strategy=fsdp``): every rank writes its own shards of the model and optimizers.

``torch.distributed.checkpoint`` (DCP) does the sharded part: ``get_state_dict``/``set_state_dict``
turn the FSDP model and its optimizers into DTensor state dicts and back, its default planners
decide which rank writes which shard (and, on load, which bytes each rank reads, which is how a
snapshot taken at N ranks restores at M), and its storage layer writes one file per rank into the
snapshot's own prefix (``FileSystemWriter`` for local paths, ``FsspecWriter`` for object stores).
The rest stays elastictrain's: rank 0 writes ``state.pt`` (progress, RNG, history, config) and
commits the manifest last, listing every rank's files with sizes and checksums, so atomicity,
verification, keep-last, ``snapshots verify`` and the fallback to the previous snapshot are those of
every snapshot. DCP's own ``.metadata`` is one more object of the manifest.

With ``snapshot.durable.async_write`` every rank ``stage``s its shards into CPU buffers and writes them
from a thread (``sharded_writes.py``), over a process group of the writers' own.

Not DCP: the checksums. DCP writes no digest of its files, so each rank reads back the files it is
given (an equal share of all, while they are in the page cache) and hashes them; the manifest
needs them to find a torn or corrupt shard before anything is loaded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from elastictrain.core.config import is_local_url
from elastictrain.core.errors import SnapshotError, StorageError, one_line
from elastictrain.snapshot.format import tensors_in
from elastictrain.snapshot.staging import Stager
from elastictrain.storage.hashing import checksum_stream
from elastictrain.storage.manifest import ObjectEntry

SHARDED = "dcp"  # the manifest's meta["sharded"] of a sharded snapshot
# What DCP's save and load warn every time they run without a process group. A run of one worker has
# none (elastictrain forms no group for one process), and one process is exactly what it means.
_SINGLE_PROCESS_WARNING = (
    r"torch\.distributed is disabled, unavailable or uninitialized, "
    r"assuming the intent is to (save|load) in a single process"
)


@dataclass
class ShardFiles:
    """Shard files written (or received) for a snapshot: each one's size and checksum, and why not all were."""

    written: dict[str, ObjectEntry] = field(default_factory=dict)
    error: str | None = None  # one line: the first file that could not be written or read back

    def keep(self, files: ShardFiles) -> None:
        """Add what ``files`` wrote; its error, if this has none yet."""
        self.written.update(files.written)
        self.error = self.error or files.error


def _quiet_single_process_warning() -> None:
    """In a process with no process group, drop DCP's warning that it will act in one process: it will, as meant.

    A process-wide filter, added once, for that message alone: warnings.catch_warnings around the call would
    swap the filters of every thread (the async writer saves from its own), and the message cannot arise
    where a group exists, the only place it could mean a mistake."""
    if not dist.is_initialized():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)


class ShardedState:
    """The model and its optimizers, saved and loaded as DCP shards (every rank calls ``save`` and ``load``)."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], storage_options: dict | None = None):
        self.model = model
        self.optimizers = optimizers
        self.storage_options = storage_options or {}
        self._stager = Stager()  # async_write: this rank's shards staged on the CPU (stage), buffers reused

    def _state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizers)
        return {"model": model_state, "optim": optim_state}

    def stage(self) -> dict[str, Any]:
        """This rank's shards copied out of the live model and optimizers (``snapshot.durable.async_write``): what a
        writer thread saves while training changes the originals."""
        return self._stager.stage(self._state())

    def save(
        self, url: str, rank: int, world_size: int, step: int, staged: dict[str, Any] | None = None, group: Any = None
    ) -> dict[str, ObjectEntry]:
        """Write this rank's shards (the live ones, or ``staged``) under ``url`` (the snapshot's prefix), DCP's
        collectives over ``group`` (default: all ranks'); return this rank's share of the checksums of every file
        written (all ranks' shares together name every file)."""
        files = self.write(url, step, staged, group)
        try:
            return {name: self.checksum(url, name) for name in [*files, ".metadata"][rank::world_size]}
        except OSError as exc:
            raise StorageError(
                f"the sharded snapshot of step {step} could not be read back from {url} "
                f"({one_line(exc, 400)}) — the previous snapshot is intact"
            ) from None

    def write(self, url: str, step: int, staged: dict[str, Any] | None = None, group: Any = None) -> list[str]:
        """Every rank: write this rank's shards under ``url`` (DCP's collective save; the coordinator writes
        ``.metadata``); return the names of every rank's shard files. StorageError on every rank if one failed."""
        _quiet_single_process_warning()
        try:
            metadata = dcp.save(
                self._state() if staged is None else staged, storage_writer=self._writer(url), process_group=group
            )
            return sorted({info.relative_path for info in metadata.storage_data.values()})
        except (OSError, dcp.api.CheckpointException) as exc:
            raise StorageError(
                f"the sharded snapshot of step {step} could not be written to {url} ({one_line(exc, 400)}); "
                "check free space and permissions — the previous snapshot is intact"
            ) from None

    def local_bytes(self) -> int:
        """The bytes of this rank's own shards of the model and optimizers (what its shard files hold, about)."""
        tensors = [t for part in self._state().values() for t in tensors_in(part)]
        return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)

    def load(self, url: str, where: str) -> None:
        """Read this rank's part of the shards under ``url`` (any world size) into the model and optimizers."""
        state = self._state()
        _quiet_single_process_warning()
        try:
            dcp.load(state, storage_reader=self._reader(url))
        except (OSError, dcp.api.CheckpointException, RuntimeError) as exc:
            raise SnapshotError(
                f"{where}: its shards do not load into this model ({one_line(exc, 400)}); resume with the "
                "model that took it, or point snapshot.durable.url elsewhere to start fresh"
            ) from None
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def _writer(self, url: str) -> Any:
        if is_local_url(url):
            return FileSystemWriter(url, sync_files=True)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url, sync_files=True, **self.storage_options)

    def _reader(self, url: str) -> Any:
        if is_local_url(url):
            return FileSystemReader(url)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(url, **self.storage_options)

    def checksum(self, url: str, name: str) -> ObjectEntry:
        """The size and checksum of the file ``name`` under ``url``, read back (DCP records none)."""
        import fsspec

        with fsspec.open(f"{url.rstrip('/')}/{name}", "rb", **self.storage_options) as handle:
            return checksum_stream(handle)


def consolidated_model(url: str, storage_options: dict | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state_dict from a sharded snapshot at ``url``, in this process (no process group).

    DCP's private ``_load_state_dict`` with its ``_EmptyStateDictLoadPlanner`` is what its public
    ``format_utils.dcp_to_torch_save`` runs; called here with ``keys={"model"}`` it reads the
    model's entries alone, not the optimizers' (two more copies of the model's size for Adam).
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = ShardedState(nn.Module(), [], storage_options)._reader(url)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    return state["model"]
