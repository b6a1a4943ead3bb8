"""Replicas stay replicas: every rank's copy of the replicated state is compared before a snapshot commits.

Under DDP every rank holds the same model and optimizer, and a snapshot saves rank 0's alone. A
loop that forgot ``session.wrap()``, or calls the raw module instead of the wrapper, lets each rank
train its own model: the run would end with exit 0, different weights per rank, and snapshots of
rank 0's. So before every snapshot (durable and fast copies) and at the run's end, each rank
fingerprints its replicated state, one ``all_gather`` of the small digests follows, and a
difference stops the run (``ReplicasDiverged``, a usage error no restart fixes) before anything of
that step is committed. ``dist.check_replicas=false`` turns it off.

What is replicated, and so compared, of each registered model and optimizer:

- a model's parameters, and its buffers that are not floating point (counters such as BatchNorm's
  ``num_batches_tracked``). Floating-point buffers (BatchNorm's running statistics) are left out:
  each rank updates them from its own batch in the forward pass, and DDP puts rank 0's back at the
  next forward (``broadcast_buffers``), so they differ between ranks by design between two steps;
- an optimizer's state (moments, step counts) and its hyperparameters (``param_groups`` without
  the parameters);
- under ``dist.strategy=fsdp`` the parameters and optimizer moments are DTensor shards, different on
  every rank by design: a DTensor is compared only when it is replicated on every rank (placements
  all ``Replicate``). What remains are the parameters FSDP did not shard (a model left unwrapped),
  the non-floating-point buffers, the optimizer's step counts and hyperparameters.

A fingerprint is xxh3-64 of each tensor's bytes with its name, dtype and shape, one digest per
object and part: exact to the bit, ~33 ms of CPU per ~200 MB on each rank, where float64 sums
cost 40 times more and miss a swap of two elements (benchmarks/replica_check_cost.py). A tensor
on an accelerator is copied to the host to be hashed. Everything else a rank holds (its RNG, its
data position, its metric sums) is its own and is not compared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import nn

from elastictrain.core.errors import ReplicasDiverged
from elastictrain.dist.collectives import all_gather
from elastictrain.dist.group import DistContext

log = logging.getLogger("elastictrain")

Part = tuple[str, str]  # (registered name, "parameters" | "buffers" | "optimizer state" | "hyperparameters")


def fingerprint(objects: dict[str, Any]) -> dict[Part, int]:
    """The digest of each registered model's and optimizer's replicated parts (the module docstring says which)."""
    digests: dict[Part, int] = {}
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            digests[(name, "parameters")] = _digest(obj.named_parameters())
            digests[(name, "buffers")] = _digest((key, b) for key, b in obj.named_buffers() if not _floating(b))
        elif isinstance(obj, torch.optim.Optimizer):
            state = obj.state_dict()
            digests[(name, "optimizer state")] = _digest(_flatten(state["state"], "state"))
            groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
            digests[(name, "hyperparameters")] = _digest(_flatten(groups, "param_groups"))
    return digests


@dataclass(frozen=True)
class Mismatch:
    parts: list[Part]  # the parts not the same on every rank
    groups: list[list[int]]  # the ranks, grouped by the whole fingerprint they hold (in rank order)


def disagreements(per_rank: list[dict[Part, int]]) -> Mismatch | None:
    """Which parts differ between the ranks' fingerprints, and which ranks hold the same; None when all agree.

    A part some rank lacks (another set of registered objects) counts as one more value."""
    parts = list(dict.fromkeys(part for digests in per_rank for part in digests))
    differing = [part for part in parts if len({digests.get(part) for digests in per_rank}) > 1]
    if not differing:
        return None
    groups: dict[tuple, list[int]] = {}
    for rank, digests in enumerate(per_rank):
        groups.setdefault(tuple(digests.get(part) for part in differing), []).append(rank)
    return Mismatch(differing, list(groups.values()))


def describe(step: int, before: str, mismatch: Mismatch) -> str:
    """The one line a mismatch stops the run with: where, which registered objects, which ranks."""
    by_object: dict[str, list[str]] = {}
    for name, what in mismatch.parts:
        by_object.setdefault(name, []).append(what)
    objects = ", ".join(f"{name!r} ({', '.join(whats)})" for name, whats in by_object.items())
    return (
        f"the ranks' replicas differ at step {step}, before {before}: ranks {' | '.join(map(_ranks, mismatch.groups))} "
        f"hold different {objects}; nothing of this step was committed. Each rank trains its own copy when a model "
        "is not wrapped by session.wrap() or the module itself is called instead of what wrap() returned "
        "(docs/guides/custom-loops.md); dist.check_replicas=false turns this check off"
    )


class ReplicaCheck:
    """Every rank, at a snapshot or the run's end: the registered models and optimizers are the same on every rank.

    Once per step: the run's end after a snapshot of its last step (``snapshot.durable.on_done``) has nothing new
    to compare, since nothing trains between the two. A rollback (``forget``) trains that step again."""

    def __init__(self, ctx: DistContext, objects: dict[str, Any], enabled: bool) -> None:
        self.ctx = ctx
        self.objects = {
            name: obj for name, obj in objects.items() if isinstance(obj, (nn.Module, torch.optim.Optimizer))
        }
        self.enabled = enabled and ctx.world_size > 1 and bool(self.objects)
        self.agreed_step: int | None = None  # the step whose replicas were found equal last

    def check(self, step: int, before: str) -> None:
        """Raise ReplicasDiverged on every rank alike when any rank's replicated state differs from another's."""
        if not self.enabled or step == self.agreed_step:  # every rank skips alike: each saw the same steps agree
            return
        started = time.perf_counter()
        mismatch = disagreements(all_gather(fingerprint(self.objects), self.ctx))
        if mismatch is not None:
            raise ReplicasDiverged(describe(step, before, mismatch))
        self.agreed_step = step
        log.debug("replicas agree at step %d (%.1f ms)", step, (time.perf_counter() - started) * 1e3)

    def forget(self) -> None:
        """After a rollback: the steps from the snapshot on are trained again, and checked again."""
        self.agreed_step = None


def _ranks(ranks: list[int]) -> str:
    """0,2,5-9: a group of ranks, runs as ranges."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _flatten(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a nested optimizer state, dicts in sorted key order."""
    if isinstance(value, dict):
        for k in sorted(value, key=repr):
            yield from _flatten(value[k], f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{key}.{index}")
    else:
        yield key, value


def _digest(items: Iterator[tuple[str, Any]]) -> int:
    hasher = xxhash.xxh3_64()
    for key, value in items:
        if isinstance(value, torch.Tensor):
            tensor = _comparable(value)
            if tensor is None:
                continue
            hasher.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            hasher.update(_bytes_of(tensor))
        elif isinstance(value, (bool, int, float, str, type(None))):
            hasher.update(f"{key}={value!r}".encode())
        else:  # an object of its own (a callable in a param group): its repr may hold a per-process address
            hasher.update(f"{key}:{type(value).__qualname__}".encode())
    return hasher.intdigest()


def _comparable(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor every rank should hold alike; None for a shard of a DTensor (FSDP), different per rank by design."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(tensor, DTensor):
        if not all(isinstance(placement, Replicate) for placement in tensor.placements):
            return None
        tensor = tensor.to_local()
    return tensor.detach()


def _bytes_of(tensor: torch.Tensor) -> Any:
    """The tensor's bytes without a copy where it can (a contiguous CPU tensor)."""
    if tensor.layout is not torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.resolve_conj().resolve_neg().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()
