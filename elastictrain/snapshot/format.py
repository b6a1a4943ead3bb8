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
import mmap
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastictrain.core.errors import SnapshotError
from elastictrain.storage.mapped import MappedFile, ObjectData

FORMAT_VERSION = 1
MODEL_OBJECT = "model.pt"
STATE_OBJECT = "state.pt"


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


_ZIP_MAGIC = b"PK\x03\x04"  # what a torch.save file (a zip archive) starts with


def load_object(data: ObjectData, where: str, map_location: torch.device | str = "cpu") -> Any:
    """Unpickle a payload with ``weights_only=True``: tensors and plain containers only, never code.

    A ``MappedFile`` (a local store's object, read into memory of this process's own: storage/mapped.py) is
    mapped by ``torch.load``, shared, so its tensors live in that memory as it is, with no copy; written in
    place (an optimizer's moments) they stay there, where a private map would copy each page on write."""
    try:
        if isinstance(data, MappedFile) and data[: len(_ZIP_MAGIC)] == _ZIP_MAGIC:
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
                return torch.load(data.path, map_location=map_location, weights_only=True, mmap=True)
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


def load_model_weights(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    where: str,
    start_fresh: str = "start fresh with snapshot.durable.url set to an empty location",
) -> None:
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
            for label, items in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape (snapshot vs model)", reshaped),
            )
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
