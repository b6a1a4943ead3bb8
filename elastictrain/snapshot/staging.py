"""Copy a state tree into CPU buffers that are reused from one snapshot to the next.

An asynchronous snapshot must not serialise live tensors: the optimizer changes them in place at
the next step. ``Stager.stage`` copies every tensor of a (nested dict/list/tuple) state tree
into a CPU buffer kept under the tensor's path in the tree, and rebuilds the containers, so the
tree it returns shares nothing with training. The buffers are allocated once (pinned when the
source is on a GPU, so the device-to-host copy can run without blocking) and reused while
shapes and dtypes stay the same: a copy into a reused buffer costs a memcpy, not an
allocation, and resident memory stays flat over any number of snapshots.

Leaves that are not tensors are deep-copied, but for numbers and strings, which are immutable and
kept as they are. Tensors that share storage (tied weights) are staged twice: loading copies values
into the live parameters, so the tie survives a restore. A ``DTensor`` (an FSDP shard) stages this
rank's local part and keeps its global layout, so DCP saves the staged copy as it would the live one.

The one stager of the package: replicated snapshots stage their state tree here and sharded ones
their ``get_state_dict`` shards (``sharded.ShardedState.stage``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.tensor import DTensor

Path = tuple[Any, ...]
# The leaves most state trees are made of (history, counters), kept as they are (bool is an int).
_IMMUTABLE = (int, float, complex, str, bytes)


class Stager:
    """``stage(tree)`` -> a copy of ``tree`` whose tensors live in buffers owned by this stager."""

    def __init__(self) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._used: set[Path] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers (the extra memory asynchronous snapshots cost)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def stage(self, tree: Any) -> Any:
        """Copy ``tree``; on a GPU the copies are issued non-blocking and waited for before returning."""
        self._used = set()
        staged = self._copy(tree, ())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies are done
        # A tensor that is gone (a parameter group removed) frees its buffer.
        for path in set(self._buffers) - self._used:
            del self._buffers[path]
        return staged

    def _copy(self, node: Any, path: Path) -> Any:
        if node is None or isinstance(node, _IMMUTABLE):  # deepcopy would return it as it is, a call later
            return node
        if isinstance(node, DTensor):
            # What torch's own CPU staging for DCP does: the local shard on the CPU under the same spec
            # (DTensor.from_local would move it back to the mesh's device).
            return DTensor(self._tensor(node.to_local(), path), node._spec, requires_grad=False)
        if isinstance(node, torch.Tensor):
            return self._tensor(node, path)
        if isinstance(node, dict):
            copied = {key: self._copy(value, (*path, key)) for key, value in node.items()}
            if isinstance(node, OrderedDict):  # a module's state_dict, with the version metadata load_state_dict reads
                copied = OrderedDict(copied)
                if hasattr(node, "_metadata"):
                    copied._metadata = copy.deepcopy(node._metadata)  # type: ignore[attr-defined]  # torch sets it on the dict
            return copied
        if isinstance(node, list):
            return [self._copy(value, (*path, index)) for index, value in enumerate(node)]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(self._copy(value, (*path, index)) for index, value in enumerate(node))
        return copy.deepcopy(node)

    def _tensor(self, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        source = tensor.detach()
        if source.layout != torch.strided or source.is_quantized:  # rare: a fresh copy, no reuse
            return source.to("cpu", copy=True)
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(
                source.shape, dtype=source.dtype, device="cpu", pin_memory=source.device.type == "cuda"
            )
            self._buffers[path] = buffer
        self._used.add(path)
        buffer.copy_(source, non_blocking=source.device.type == "cuda")
        return buffer
