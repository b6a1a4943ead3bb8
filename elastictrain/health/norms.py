"""Gradient norms as the checks and clipping read them: one pass over the gradients, one host read."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from elastictrain.dist.fsdp import full_value


def grad_norm(parameters: Iterable[torch.Tensor]) -> float:
    """The global 2-norm of the gradients (what ``clip_grad_norm_`` computes), as a Python float: one read of
    the gradients and one host read. ``get_total_norm``'s grouping by device and dtype costs ~4x more per call
    than the norm itself for a small model; its result is what clipping uses, so with clipping on the loop
    checks that one instead (step_runner.py)."""
    return norm_of([p.grad for p in parameters if p.grad is not None])


def clipping_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of the gradients as ``clip_grad_norm_`` computes it (its first half, FSDP's shards as
    one), a tensor to hand to ``torch.nn.utils.clip_grads_with_norm_`` (its second half): one norm, read once."""
    return full_value(torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], 2.0))


def norm_of(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of all ``tensors`` together, as a Python float (0.0 for none)."""
    if not tensors:
        return 0.0
    if any(isinstance(t, DTensor) for t in tensors):  # FSDP's shards: the global norm, never one rank's part
        # get_total_norm of DTensors is a DTensor (torch's stub says Tensor)
        return float(torch.nn.utils.get_total_norm(tensors, 2.0).full_tensor())  # type: ignore[attr-defined]
    if len({(t.device, t.dtype) for t in tensors}) > 1:  # one foreach call takes one device and dtype
        return float(torch.nn.utils.get_total_norm(tensors, 2.0))
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2.0))))
