"""One torchrun worker for benchmarks/recovery.py: the textbook DDP loop that checkpoints with torch.save and reloads it.

As the PyTorch DDP tutorial and nanoGPT do it: ``dist.init_process_group("gloo")`` from torchrun's
variables, rank 0 ``torch.save``s model, optimizer and scheduler onto one file every
``--every`` steps, and every rank ``torch.load``s that file at start if it exists. It imports
torch and nothing of elastictrain, so its start-up costs what a hand-written script's does. The
two tasks mirror elastictrain's default task (the spirals MLP with Adam and a StepLR) and
``benchmarks/_big_task.py`` (the 16.7 M-parameter MLP with Adam), rebuilt here with torch alone.

Every event is one line ``textbook rank R restart A t=<unix s> <event>`` on stdout: ``start pid
P`` (timed before ``import torch``), ``imported``, ``pg-up``, ``built`` (model, optimizer, data: the
first optimizer imports ``torch._dynamo``), ``ddp`` (wrapped), ``loaded`` (a checkpoint was read
and loaded), ``step N`` after each optimizer step, ``saved N``.
"""

import time

STARTED_UNIX = time.time()  # before any import that takes time

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

IMPORTED_UNIX = time.time()


def spirals(samples: int = 8192, classes: int = 3, noise: float = 0.15, seed: int = 1234):
    """elastictrain.train.tasks.spirals' model, optimizer, scheduler and training data, with its defaults."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (samples,), generator=generator)
    radius = torch.rand(samples, generator=generator)
    angle = labels * (2 * math.pi / classes) + radius * 1.75 * math.pi
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    points += noise * radius.unsqueeze(1) * torch.randn(samples, 2, generator=generator)
    model = nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(128, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=400, gamma=0.5)
    return model, optimizer, scheduler, TensorDataset(points, labels), 32


def big(width: int = 4096, samples: int = 2048, features: int = 64):
    """benchmarks/_big_task.py's model, optimizer and data."""
    model = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, features, generator=generator), torch.randint(0, 10, (samples,), generator=generator))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10**9)
    return model, optimizer, scheduler, data, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("spirals", "big"), required=True)
    parser.add_argument("--checkpoint", type=pathlib.Path, required=True)
    parser.add_argument("--every", type=int, required=True, help="checkpoint every this many steps")
    parser.add_argument("--max-steps", type=int, default=10**9)
    args = parser.parse_args()
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def event(what: str, when: float | None = None) -> None:
        # One write per line: the two workers share the agent's stdout, and print() writes the newline apart.
        sys.stdout.write(f"textbook rank {rank} restart {restart} t={time.time() if when is None else when:.3f} {what}\n")
        sys.stdout.flush()

    event(f"start pid {os.getpid()}", STARTED_UNIX)
    event("imported", IMPORTED_UNIX)
    dist.init_process_group("gloo")
    event("pg-up")
    torch.manual_seed(0)
    model, optimizer, scheduler, data, batch_size = spirals() if args.task == "spirals" else big()
    event("built")
    ddp = nn.parallel.DistributedDataParallel(model)
    event("ddp")
    step = 0
    if args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        step = checkpoint["step"]
        event("loaded")
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    epoch = step // len(loader)
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            loss = F.cross_entropy(ddp(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            event(f"step {step}")
            if rank == 0 and step % args.every == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "step": step}, args.checkpoint)
                event(f"saved {step}")
            if step >= args.max_steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
