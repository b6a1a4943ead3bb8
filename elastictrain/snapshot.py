"""What a snapshot holds, and turning it into bytes and back without ever running code from a file.

A snapshot is the dict of every Stateful's ``state_dict()`` (model, optimizer, LR scheduler,
grad scaler, progress, history), each rank's RNG states, the config and a format version. It is
stored as two payload objects: ``model.pt`` (the unwrapped model's weights alone, so weights can
be taken without the rest) and ``state.pt`` (everything else). Both are read back with
``torch.load(weights_only=True)``, which refuses any pickle that would construct arbitrary objects.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, BinaryIO, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import SnapshotError

FORMAT_VERSION = 1
MODEL_OBJECT = "model.pt"
STATE_OBJECT = "state.pt"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """Where training is. ``epoch_offset`` counts global samples, so it re-shards over any world size."""

    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed (the current epoch's index)
    epoch_offset: int = 0  # global samples consumed in the current epoch
    samples_seen: int = 0  # global samples consumed in all epochs
    last_evaluated_step: int = -1
    last_snapshot_step: int = -1
    last_local_snapshot_step: int = -1  # the fast tier's

    def advance(self, samples: int) -> None:
        self.global_step += 1
        self.epoch_offset += samples
        self.samples_seen += samples

    def end_epoch(self) -> None:
        self.epoch += 1
        self.epoch_offset = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state_dict.get(f.name, f.default)))  # a newer counter is absent from older snapshots


@dataclass
class History:
    """Reduced metrics over time: one record per log interval or evaluation, identical on every rank."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def append(self, **record: Any) -> None:
        self.records.append(record)

    def last(self, key: str) -> Any:
        for record in reversed(self.records):
            if key in record:
                return record[key]
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(r) for r in self.records]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state_dict["records"]]


@dataclass
class RunLog:
    """One record per attempt (launch or restart) of this run, so run-level figures survive relaunches."""

    attempts: list[dict[str, Any]] = field(default_factory=list)

    def begin(self, *, restart_count: int, world_size: int, start_step: int, launcher: str, started_unix: float,
              restored: bool) -> dict[str, Any]:
        if not restored:
            reason = "fresh"
        elif restart_count > 0:
            reason = "restart"  # the launcher restarted the workers after a failure
        else:
            reason = "relaunch"  # a new launch (after preemption, a lost node, or by hand) resumed
        attempt = {
            "restart_count": restart_count, "world_size": world_size, "start_step": start_step,
            "started_unix": started_unix, "launcher": launcher, "reason": reason,
            "preempted": 0, "wall_s": 0.0,
        }
        self.attempts.append(attempt)
        return attempt

    @property
    def current(self) -> dict[str, Any]:
        return self.attempts[-1]

    def total(self, key: str) -> float:
        return sum(attempt.get(key, 0) for attempt in self.attempts)

    def state_dict(self) -> dict[str, Any]:
        return {"attempts": [dict(a) for a in self.attempts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.attempts = [dict(a) for a in state_dict["attempts"]]


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (python, numpy, torch CPU, and CUDA when used) in loadable types."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            # On CUDA the state object is loaded onto the device (the optimizer's tensors belong there): RNG states come back.
            "state": {"key": numpy_state["key"].cpu().numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def seed_rng(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# torch.save's per-record CRC-32 cost ~57 ms of a ~60 ms save of a 200 MB state (zlib's crc32 at
# ~3.5 GB/s, with the GIL held), and torch.load never checks it; the store checksums every byte
# already. The switch is torch's global, so it is flipped only around our own saves, one at a time.
_SAVE_LOCK = threading.Lock()


def save_object(obj: Any, fileobj: BinaryIO) -> None:
    """torch.save ``obj`` into ``fileobj`` without the zip records' CRC-32 (torch.load reads the result as usual).

    While it runs, a torch.save in another thread of this process also skips the CRC-32: its
    file still loads, but ``unzip -t`` would call it damaged.
    """
    if not hasattr(torch.serialization, "set_crc32_options"):  # an older torch always computes it
        torch.save(obj, fileobj)
        return
    with _SAVE_LOCK:
        computed = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(obj, fileobj)
        finally:
            torch.serialization.set_crc32_options(computed)


def writer_for(obj: Any) -> Callable[[BinaryIO], None]:
    """A storage writer that streams ``obj`` through torch.save (``save_object``) into the file it is given."""

    def write(fileobj: BinaryIO) -> None:
        save_object(obj, fileobj)

    return write


# What torch.load raises for bytes that are not a torch file, or a torch file torn or garbled:
# weights_only's refusal and pickle errors (UnpicklingError), an empty file (EOFError), the zip
# reader's RuntimeErrors (below), and, for garbage parsed as the legacy format, ValueError (a
# negative seek, bad UTF-8), KeyError and IndexError.
_UNREADABLE_FILE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError)
# The RuntimeErrors of torch's zip reader (caffe2 inline_container), as torch 2.13 words them. Any
# other RuntimeError while loading (out of memory, a CUDA device that is not there) is not about
# the file and propagates as what it is.
_ZIP_READER_ERRORS = ("PytorchStreamReader", "inline_container", "hasRecord(")


def load_object(data: bytes, where: str, map_location: torch.device | str = "cpu") -> Any:
    """Unpickle a payload with ``weights_only=True``: tensors and plain containers only, never code."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except (*_UNREADABLE_FILE_ERRORS, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not any(mark in str(exc) for mark in _ZIP_READER_ERRORS):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        if not isinstance(exc, (pickle.UnpicklingError, RuntimeError)):  # KeyError('101') alone says nothing
            lines = [f"{type(exc).__name__}: {line}".rstrip(": ") for line in lines]
        # torch's message is a page long; its one informative line names the refused global, or
        # follows "WeightsUnpickler error:" for bytes that are no pickle at all.
        reason = next((line for line in lines if "global" in line.lower() and "weights_only" not in line), None)
        if reason is None:
            unpickler = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
            reason = f"unpickling failed: {unpickler.group(1).strip()}" if unpickler else lines[0]
        raise SnapshotError(
            f"{where} cannot be loaded safely ({reason}); it is not an elastictrain snapshot "
            "or holds objects other than tensors and plain containers — nothing was executed"
        ) from None


COMPILE_WRAPPER = "_orig_mod"  # the attribute torch.compile's OptimizedModule keeps the model under


def without_compile_wrapper(weights: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``weights`` saved from a torch.compile'd model as is (every key with ``_orig_mod.`` in it), named as ``own``.

    Snapshots hold the plain model's names (ddp.unwrap takes the compile wrapper off); a snapshot whose names carry
    it (from a model registered compiled by an earlier version, or saved elsewhere) loads into the plain model.
    Unchanged when ``own`` itself has the wrapper's names or ``weights`` has none.
    """
    def plain(key: str) -> str:
        return ".".join(part for part in key.split(".") if part != COMPILE_WRAPPER)

    if any(COMPILE_WRAPPER in key.split(".") for key in own) or not any(plain(key) != key for key in weights):
        return weights
    renamed = OrderedDict((plain(key), value) for key, value in weights.items())
    metadata = getattr(weights, "_metadata", None)
    if metadata is not None:  # per-module versions load_state_dict reads (BatchNorm's), under the plain names
        renamed._metadata = {plain(key): value for key, value in metadata.items()}  # type: ignore[attr-defined]  # as torch
    return renamed


def load_model_weights(model: nn.Module, weights: dict[str, torch.Tensor], where: str,
                       start_fresh: str = "start fresh with snapshot.durable.url set to an empty location") -> None:
    """Load weights strictly; a different model is one clear error naming the differences and ``start_fresh``."""
    own = model.state_dict()
    weights = without_compile_wrapper(weights, own)
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    reshaped = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(weights))
        if weights[k].shape != own[k].shape
    ]
    if missing or unexpected or reshaped:
        parts = [
            f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shape (snapshot vs model)", reshaped))
            if items
        ]
        raise SnapshotError(
            f"{where} was saved from a different model ({'; '.join(parts)}); point snapshot.durable.url at this "
            f"model's snapshots, or {start_fresh} — nothing was deleted"
        )
    model.load_state_dict(weights)


def params_sha256(model: nn.Module) -> str:
    """A fingerprint of a model: sha256 over every state entry's name, dtype, shape and bytes, sorted by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if isinstance(tensor, DTensor):  # FSDP's shard: the whole tensor (a collective: every rank hashes)
            tensor = tensor.full_tensor()
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tensors_in(tree: Any) -> list:
    """Every tensor in a state_dict-like tree of dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in tensors_in(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in tensors_in(value)]
    return []
