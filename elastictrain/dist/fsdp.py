"""FSDP2 (``dist.strategy=fsdp``): the user's model sharded across the ranks with ``fully_shard``.

The default wrapping shards each *block* and then the root. A block is a child, holding
parameters, of an ``nn.ModuleList`` or ``nn.Sequential`` (the outermost such containers only: a
block's own inner lists stay inside it). A model the user already ``fully_shard``-ed is used as is.
``fully_shard`` replaces each parameter by a sharded one (a DTensor): an optimizer built on the
old ones is pointed at the new ones (``rebind``), as long as it has not stepped yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from elastictrain.core.errors import UsageError


def is_sharded(model: nn.Module) -> bool:
    """The user's model (or a part of it) went through ``fully_shard`` already."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules the default wrapping shards one by one (the module docstring says which)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, (nn.ModuleList, nn.Sequential)) and any(True for _ in child.parameters()):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def shard_model(root: nn.Module, model: nn.Module) -> nn.Module:
    """``fully_shard`` the blocks of ``model`` (unless the user sharded it already), then ``root``
    (``model`` itself, or the LossForward around it, so that a loss_fn reaching any submodule finds
    its parameters gathered)."""
    if not is_sharded(model):
        for block in blocks(model):
            fully_shard(block)
    if not isinstance(root, FSDPModule):
        fully_shard(root)
    return root


def replaced_parameters(before: dict[str, nn.Parameter], model: nn.Module) -> dict[int, nn.Parameter]:
    """id(old parameter) -> the sharded parameter that took its place under the same name."""
    after = dict(model.named_parameters())
    return {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}


def rebind(optimizer: torch.optim.Optimizer, replaced: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer`` at the sharded parameters that replaced the ones it was built on."""
    if not replaced or not any(id(p) in replaced for group in optimizer.param_groups for p in group["params"]):
        return
    if optimizer.state:
        raise UsageError(
            f"a {type(optimizer).__name__} that has stepped already cannot follow the model into FSDP: build and "
            "register the optimizer before its first step (dist.strategy=fsdp shards the model in session.wrap)"
        )
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def full_value(tensor: Any) -> Any:
    """A DTensor's whole value (a collective: every rank calls it), anything else as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
