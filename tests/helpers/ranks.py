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


def run(target, world: int, *args) -> list:
    """Start ``target(rank, *args, results)`` on ``world`` fresh ranks; each puts one item on ``results``.

    Returns the items in the order they arrived, after every rank exited 0; a rank left alive is killed."""
    ctx = context()
    results = ctx.Queue()
    workers = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(world)]
    for worker in workers:
        worker.start()
    try:
        got = [results.get(timeout=60) for _ in workers]
        for worker in workers:
            worker.join(30)
            assert worker.exitcode == 0
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    return got
