"""Real worker processes for tests that start gloo ranks themselves (multiprocessing, not torchrun).

Each rank is a fresh process, as with "spawn", but forked from a forkserver that has imported torch
once: a spawned rank re-imports torch (1.5 s of CPU on each of 2 cores), a forked one does not.
The forkserver itself starts no threads and no process group, so every rank begins clean.
"""

from __future__ import annotations

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.nn", "elastictrain.dist.group"]


def context():
    """The multiprocessing context to start ranks with (its forkserver preloads PRELOAD)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
