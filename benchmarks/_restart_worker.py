"""One torchrun worker for benchmarks/restart_recovery.py: DDP training with one of two process-group inits.

``--init textbook`` is ``dist.init_process_group("gloo")`` (env://), as in the PyTorch DDP
tutorial; ``--init elastictrain`` is ``elastictrain.dist.group.setup``. Everything after the init is
the same code, so the benchmark compares only the init. On restart 0, rank 1 writes its pid to
``<workdir>/kill-me.pid`` at step 5 and keeps training, for the harness to SIGKILL it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import torch
import torch.distributed as dist
from torch import nn

STEPS = 40
STEP_SLEEP_S = 0.05
KILL_AT_STEP = 5
KILLED_RANK = 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=("textbook", "elastictrain"), required=True)
    parser.add_argument("--workdir", type=pathlib.Path, required=True, help="where kill-me.pid is written")
    args = parser.parse_args()

    # Benchmark code, not library code: the textbook path reads torchrun's variables itself.
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.init == "textbook":
        dist.init_process_group("gloo")
        ctx = None
    else:
        from elastictrain.core.config import DistConfig
        from elastictrain.dist.group import setup

        ctx = setup(DistConfig(init_timeout_s=30, collective_timeout_s=30))
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"rank {rank} restart {restart_count} step {step}", flush=True)
        if restart_count == 0 and rank == KILLED_RANK and step == KILL_AT_STEP:
            _write_pid(args.workdir / "kill-me.pid")
        time.sleep(STEP_SLEEP_S)

    if ctx is None:
        dist.barrier()
        dist.destroy_process_group()
    else:
        from elastictrain.dist.group import teardown

        teardown(ctx)
    print(f"rank {rank} restart {restart_count} done", flush=True)


def _write_pid(path: pathlib.Path) -> None:
    # Renamed into place so the harness never reads a half-written pid.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(str(os.getpid()))
    os.replace(partial, path)


if __name__ == "__main__":
    main()
