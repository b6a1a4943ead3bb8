"""The user's model on this worker's device, wrapped in DDP when there are several workers.

``LossForward`` puts the user's ``loss_fn`` inside DDP's forward, so every gradient it makes is synced.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

from torch import nn

from elastictrain.core.config import DistConfig
from elastictrain.core.errors import ConfigError
from elastictrain.dist import fsdp
from elastictrain.dist.group import DistContext


def wrap_model(
    model: nn.Module, ctx: DistContext, cfg: DistConfig, environ: Mapping[str, str] | None = None
) -> nn.Module:
    """Move to the device; under DDP convert BatchNorm if asked and wrap; under FSDP shard (fsdp.py)."""
    model.to(ctx.device)
    if not ctx.distributed:
        return model
    if cfg.strategy == "fsdp":
        return fsdp.shard_model(model, unwrap(model))
    if cfg.sync_batchnorm:
        if ctx.device.type != "cuda":
            raise ConfigError(
                "dist.sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm does not run on CPU); "
                "set dist.sync_batchnorm=false"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    find_unused = cfg.find_unused_parameters
    if find_unused is None:
        env = os.environ if environ is None else environ
        find_unused = env.get("DDP_FIND_UNUSED_PARAMETERS", "false").lower() in ("1", "true", "yes")
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=find_unused)


class LossForward(nn.Module):
    """The user's ``loss_fn(model, batch)`` as one module's forward, so that DDP wraps the whole loss.

    DDP arms its gradient all-reduce in its own forward: a loss_fn that reached a submodule of a
    DDP wrapper (``model.G(x)``) would find no ``G`` there, and calling ``wrapper.module.G`` would
    skip the all-reduce, each rank then stepping on its own gradients. Run inside DDP's forward,
    loss_fn gets the user's own module, on one worker or many alike, and every gradient it makes is synced.
    """

    loss_fn: Callable[..., Any]  # in __dict__, not a registered submodule

    def __init__(self, model: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.model = model
        self.__dict__["loss_fn"] = loss_fn  # never a submodule, even as an nn.Module: its weights are not the model's

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: without DDP's wrapper and the LossForward around it."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model.model if isinstance(model, LossForward) else model


def state_module(model: nn.Module) -> nn.Module:
    """The module whose state_dict is the snapshot's weights: ``unwrap``'s, and torch.compile's wrapper off too.

    torch.compile returns an OptimizedModule whose state_dict keys all start with ``_orig_mod.``; the module it
    wraps holds the same parameters, so snapshots of a compiled model are the plain model's (a compiled and an
    uncompiled run resume from each other's snapshots, with the same params_sha256).
    """
    model = unwrap(model)
    while isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):  # torch._dynamo's OptimizedModule
        model = unwrap(inner)
    return model


def no_sync(model: nn.Module, skip_sync: bool) -> Any:
    """DDP's no_sync() for all micro-batches but the last of an accumulated step."""
    if skip_sync and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return nullcontext()
