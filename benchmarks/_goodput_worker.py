"""One torchrun worker of benchmarks/goodput.py: the same model, data and batch trained by a textbook DDP loop or by elastictrain.

``--loop textbook`` is the PyTorch DDP tutorial's fault-tolerance recipe: rank 0 writes
``torch.save({model, optimizer, epochs_run})`` to one path at the end of every epoch, and every
rank of a restarted attempt loads it and starts again at the beginning of the next epoch.
``--no-checkpoint`` leaves the save out (the unbroken reference runs).
``--loop elastictrain`` hands the same objects to ``elastictrain.Trainer``; ``--config`` (JSON)
is merged into its config, which is how the benchmark turns on the fast tier and async writes.

Both print lines the harness parses, each ``goodput-bench a<restart> r<rank> <event> <unix time>``
with an optional ``step=<n>``: ``exec`` (when the process was created, read from /proc, so the
interpreter's own start counts), ``imported``, ``pg`` (textbook only: process group up;
elastictrain logs a line of its own), ``group`` (set-up done: process group, model, DDP and
optimizer ready), ``restored`` (the step training resumes from; 0 when fresh), ``step`` (rank 0,
at the forward of every optimizer step, numbered from 1), ``saved`` (textbook: a checkpoint
written, with its duration), ``goodput`` (elastictrain, rank 0: its own counters at the end),
``done``. elastictrain's own log lines (millisecond timestamps) come on stderr.
"""

from __future__ import annotations

import os
import sys
import time

from elastictrain.launcher.warm_client import process_started_unix  # standard library only: torch is not imported yet

CREATED_UNIX = process_started_unix()  # before torch is imported: the import is part of a restart's cost

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

FEATURES = 1024
CLASSES = 10
BATCH_SIZE = 32  # per rank
DISTINCT_SAMPLES = 4096  # the dataset repeats this many random rows: building it costs no restart seconds


class RepeatingData(Dataset):
    """``samples`` labelled random vectors, repeating every DISTINCT_SAMPLES rows (the cost measured is not learning)."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(DISTINCT_SAMPLES, FEATURES, generator=generator)
        self.labels = torch.randint(0, CLASSES, (DISTINCT_SAMPLES,), generator=generator)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index % DISTINCT_SAMPLES], self.labels[index % DISTINCT_SAMPLES]


def build_model() -> nn.Module:
    """4 x (Linear(1024, 1024) + ReLU) + Linear(1024, 10): 4.2 M parameters, ~50 MB with AdamW's moments."""
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(FEATURES, FEATURES), nn.ReLU())],
                         nn.Linear(FEATURES, CLASSES))


class Stamps:
    """Prints the harness's ``goodput-bench`` lines; per-step lines on rank 0 only."""

    def __init__(self, rank: int, restart: int) -> None:
        self.prefix = f"goodput-bench a{restart} r{rank}"
        self.rank = rank

    def event(self, name: str, when: float | None = None, **fields: object) -> None:
        extra = "".join(f" {key}={value}" for key, value in fields.items())
        sys.stdout.write(f"{self.prefix} {name} {time.time() if when is None else when:.6f}{extra}\n")
        sys.stdout.flush()

    def step(self, step: int) -> None:
        if self.rank == 0:
            self.event("step", step=step)


def textbook(args: argparse.Namespace, stamps: Stamps, world_size: int) -> None:
    data = RepeatingData(args.epoch_steps * BATCH_SIZE * world_size)
    dist.init_process_group("gloo")
    stamps.event("pg")
    rank = dist.get_rank()
    model = build_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stamps.event("group")
    checkpoint = args.workdir / "checkpoint.pt"
    epochs_run = 0
    if checkpoint.exists():  # every rank loads it, as in the tutorial
        saved = torch.load(checkpoint, map_location="cpu")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        epochs_run = saved["epochs_run"]
    stamps.event("restored", step=epochs_run * args.epoch_steps)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
    step = epochs_run * args.epoch_steps
    for epoch in range(epochs_run, args.epochs):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            step += 1
            stamps.step(step)
            loss = F.cross_entropy(ddp(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if rank == 0 and args.checkpoint:
            started = time.monotonic()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": epoch + 1}, checkpoint)
            stamps.event("saved", step=step, duration_s=f"{time.monotonic() - started:.3f}")
    dist.destroy_process_group()
    stamps.event("done", step=step)


def with_elastictrain(args: argparse.Namespace, stamps: Stamps, world_size: int) -> None:
    from elastictrain import State, Trainer  # imported already, before the "imported" stamp

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        stamps.step(trainer.progress.global_step + 1)  # called once per optimizer step: no validation data, no accumulation
        inputs, labels = batch
        return F.cross_entropy(module(inputs), labels)

    overrides = json.loads(args.config)
    config = {
        "run": {"dir": str(args.workdir / "run"), "name": "goodput"},
        "train": {"max_epochs": args.epochs, "batch_size": BATCH_SIZE},
        "log": {"progress_bar": False, "plots": False},
        **{key: value for key, value in overrides.items() if key != "snapshot"},
        "snapshot": {**overrides.get("snapshot", {}), "durable": {
            "url": str(args.workdir / "snapshots"), **overrides.get("snapshot", {}).get("durable", {})}},
    }
    trainer = Trainer(model, optimizer, RepeatingData(args.epoch_steps * BATCH_SIZE * world_size), loss_fn, config=config)
    trainer.on(dst=State.RESTORE)(lambda src, dst, step: stamps.event("group"))
    trainer.on(src=State.RESTORE)(lambda src, dst, step: stamps.event("restored", step=step))
    summary = trainer.fit()
    if trainer.session.is_main:
        goodput = trainer.session.goodput  # the counters /metrics serves
        seconds = {cause: round(value, 3) for cause, value in goodput.seconds_by_cause().items()}
        stamps.event("goodput", ratio=f"{goodput.goodput_ratio():.4f}", seconds=json.dumps(seconds, separators=(",", ":")))
    stamps.event("done", step=summary.global_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("textbook", "elastictrain"), required=True)
    parser.add_argument("--workdir", type=pathlib.Path, required=True, help="checkpoint, snapshots and run directory")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--epoch-steps", type=int, required=True, help="optimizer steps per epoch")
    parser.add_argument("--config", default="{}", help="elastictrain: JSON merged into the config")
    parser.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True,
                        help="textbook: save at every epoch's end (--no-checkpoint: the unbroken reference, which saves nothing)")
    args = parser.parse_args()
    # Benchmark code, not library code: the worker reads torchrun's variables itself.
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stamps = Stamps(rank, restart)
    stamps.event("exec", when=CREATED_UNIX)
    if args.loop == "elastictrain":
        import elastictrain.train.trainer  # noqa: F401  (its import time is part of every restart)
    stamps.event("imported")
    run = textbook if args.loop == "textbook" else with_elastictrain
    run(args, stamps, int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
