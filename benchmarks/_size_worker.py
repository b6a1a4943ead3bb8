"""One torchrun worker of benchmarks/state_size_curve.py: a model whose snapshot is ``--mb`` MB, trained by elastictrain.

The model is ``--mb / 50`` blocks of Linear(2048, 2048) + ReLU with Adam: 4.2 M parameters a block,
~50 MB of snapshot each (weights and two moments, float32). The batch is a few rows, so a step is
mostly the optimizer's pass over the state and the gradient all-reduce: the costs measured are the
state's, not learning's.

Each rank appends JSON lines to ``<--out-dir>/rank<R>-a<restart>.jsonl``: ``snapshot`` (tier,
training blocked, background write, bytes), ``restored`` (step, seconds, from a snapshot or not),
and ``memory`` (VmRSS and VmHWM, the peak resident memory of this process) at every step's forward,
after every snapshot and at the end. Rank 0 prints ``size-bench a<restart> step <n> <unix time>`` at the forward of
every step, which the harness reads for kill -> first step.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

WIDTH = 2048
ROWS = 4  # per rank and step
BLOCK_MB = 3 * WIDTH * (WIDTH + 1) * 4 / 1e6  # weights, bias and Adam's two moments: 50.4 MB


class Rows(Dataset):
    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(64, WIDTH, generator=generator)
        self.labels = torch.randint(0, 10, (64,), generator=generator)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index % 64], self.labels[index % 64]


def memory_mb() -> dict[str, float]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
    return {key.lower() + "_mb": int(value.split()[0]) / 1024 for key, value in fields.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, required=True, help="snapshot size, MB (rounded to whole 50 MB blocks)")
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--config", default="{}", help="JSON merged into the config")
    args = parser.parse_args()
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = args.workdir / "records" / f"rank{rank}-a{restart}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"size-bench a{restart} r{rank} pid {os.getpid()}", flush=True)  # the training process (warm: not torchrun's child)

    def record(kind: str, **fields: object) -> None:
        with out.open("a") as file:
            file.write(json.dumps({"kind": kind, "unix": time.time(), **fields}) + "\n")

    from elastictrain import Trainer
    from elastictrain.core.events import Observer

    class Records(Observer):
        def snapshotted(self, report) -> None:
            record("snapshot", step=report.step, tier=report.tier, committed=report.committed, blocked_s=report.duration_s,
                   write_s=report.write_s, bytes=report.size_bytes)
            record("memory", **memory_mb())

        def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
            record("restored", step=step, seconds=duration_s, from_snapshot=from_snapshot)

    blocks = max(1, round(args.mb / BLOCK_MB))
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(blocks) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())],
                          nn.Linear(WIDTH, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    world = int(os.environ["WORLD_SIZE"])

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        record("memory", step=trainer.progress.global_step + 1, **memory_mb())  # every rank: its peak so far
        if rank == 0:
            sys.stdout.write(f"size-bench a{restart} step {trainer.progress.global_step + 1} {time.time():.6f}\n")
            sys.stdout.flush()
        inputs, labels = batch
        return F.cross_entropy(module(inputs), labels)

    overrides = json.loads(args.config)
    config = {
        "run": {"dir": str(args.workdir / "run"), "name": "size"},
        "train": {"max_epochs": 1, "max_steps": args.steps, "batch_size": ROWS, "log_every_steps": 1000},
        "log": {"progress_bar": False, "plots": False},
        **overrides,
    }
    trainer = Trainer(model, optimizer, Rows(args.steps * ROWS * world), loss_fn, config=config, observers=[Records()])
    trainer.fit()
    record("memory", end=True, **memory_mb())


if __name__ == "__main__":
    main()
