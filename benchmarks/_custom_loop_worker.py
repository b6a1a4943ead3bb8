"""One worker of the custom-loop benchmark: the same model, data, batch and steps trained by a plain
DDP loop (``hand``) or by the same loop on elastictrain's custom-loop API (``session``, snapshots off).

The two loops differ only in what the API adds: ``Session`` instead of ``init_process_group``,
``session.wrap``/``register``/``loader``/``restore``, and ``session.step(loss=loss)`` after each
optimizer step (the vote, the watchdog's heartbeat, goodput, the loss summed for the log). Both
record a timestamp before every forward on rank 0; the steady-state step time is the span between
the forward of step ``--warmup`` and the last one, divided by the steps between. The models and
data are step_overhead.py's (``_overhead_worker.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from _overhead_worker import MODELS, dataset  # benchmarks/ is this script's directory


def hand(model: nn.Module, optimizer: torch.optim.Optimizer, data, batch_size: int, stamps: list[float],
         report: Callable[[int], None]) -> None:
    dist.init_process_group("gloo")
    ddp = nn.parallel.DistributedDataParallel(model)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    for inputs, labels in DataLoader(data, batch_size=batch_size, sampler=sampler):
        stamps.append(time.perf_counter())
        loss = F.cross_entropy(ddp(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    report(dist.get_rank())  # before the teardown, which can hang here (see custom_loop.py)
    dist.destroy_process_group()


def custom_loop(model: nn.Module, optimizer: torch.optim.Optimizer, data, batch_size: int, stamps: list[float],
                report: Callable[[int], None], run_dir: str) -> None:
    from elastictrain.train.session import Session

    config = {
        "run": {"dir": run_dir},
        "train": {"max_epochs": 1, "batch_size": batch_size, "log_every_steps": 50},
        "snapshot": {"durable": {"every_steps": 0, "on_done": False, "lease_stale_after_s": 0}},
        "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
    }
    with Session(config) as session:
        ddp = session.wrap(model)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(data)
        session.restore()
        for _epoch in session.epochs():
            for inputs, labels in loader:
                stamps.append(time.perf_counter())
                loss = F.cross_entropy(ddp(inputs), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                session.step(loss=loss)
    report(session.rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("hand", "session"), required=True)
    parser.add_argument("--model", choices=tuple(MODELS), required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    data = dataset(args.model, args.steps * args.batch_size * args.world_size)
    torch.manual_seed(0)
    model = MODELS[args.model]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stamps: list[float] = []

    def report(rank: int) -> None:
        if rank == 0:
            span = stamps[-1] - stamps[args.warmup]
            with open(args.out, "w") as out:
                json.dump({"step_s": span / (len(stamps) - 1 - args.warmup), "steps": len(stamps)}, out)

    if args.mode == "hand":
        hand(model, optimizer, data, args.batch_size, stamps, report)
    else:
        custom_loop(model, optimizer, data, args.batch_size, stamps, report, args.run_dir)


if __name__ == "__main__":
    main()
