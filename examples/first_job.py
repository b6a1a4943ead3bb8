"""docs/tutorial.md's job: a small regression written from scratch as a custom loop on a Session."""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import elastictrain as et

CONFIG = {
    "run": {"name": "first-job"},
    "train": {"max_epochs": 30, "batch_size": 16, "log_every_steps": 200},
    "snapshot": {"durable": {"every_steps": 100}},
    "log": {"plots": False, "progress_bar": False},
}


def noisy_sine(samples: int) -> TensorDataset:
    """y = sin(3x) plus noise, for x in [-2, 2]: the same on every rank and in every run."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(samples, 1, generator=generator) * 4 - 2
    y = torch.sin(3 * x) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


with et.Session(CONFIG, overrides=sys.argv[1:]) as session:  # SETUP: seeds every RNG from run.seed
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ddp = session.wrap(model)  # DDP when there are several workers
    session.register(model=model, optimizer=optimizer)  # what a snapshot holds
    loader = session.loader(noisy_sine(2048))  # this rank's batches, resumable mid-epoch
    session.restore()  # the newest valid snapshot, or a fresh start
    for epoch in session.epochs():
        for x, y in loader:
            loss = F.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(loss=loss)  # the vote, snapshots, preemption, metrics
