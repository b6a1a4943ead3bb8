"""A small custom loop that goes wrong one chosen way, for the tests of errors no restart can fix.

    torchrun --nproc-per-node=2 tests/helpers/misused_loop.py RUN_DIR MISTAKE

A Linear model on 512 random points, 4 a rank per step: 64 steps, a durable snapshot every 10. MISTAKE:

- ``crash-in-step-31``: rank 1 raises the user's RuntimeError in step 31, in every attempt (a bug, not a fault);
- ``steps-on-rank-0-only``: only rank 0 calls ``session.step()``;
- ``rank-0-leaves``: rank 0 leaves its loop after step 5 while rank 1 trains on.

It imports elastictrain before torch, as the docs advise: an attempt after an error no restart can fix stops at
that import.
"""

from __future__ import annotations

import sys

import elastictrain  # before torch: an attempt after an error no restart can fix stops here
import torch
from torch import nn
from torch.utils.data import TensorDataset

MISTAKES = ("crash-in-step-31", "steps-on-rank-0-only", "rank-0-leaves")


def train(session: elastictrain.Session, loader, wrapped: nn.Module, optimizer: torch.optim.Optimizer,
          mistake: str) -> None:
    for _epoch in session.epochs():
        for inputs, targets in loader:
            if mistake == "crash-in-step-31" and session.rank == 1 and session.global_step == 30:
                raise RuntimeError("the user's bug in step 31")
            loss = nn.functional.mse_loss(wrapped(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if mistake == "steps-on-rank-0-only":
                if session.is_main:
                    session.step(loss=loss)
                continue
            session.step(loss=loss)
            if mistake == "rank-0-leaves" and session.rank == 0 and session.global_step == 5:
                return


def main(run_dir: str, mistake: str) -> None:
    assert mistake in MISTAKES, mistake
    config = {"run": {"dir": run_dir}, "train": {"max_epochs": 1, "batch_size": 4, "log_every_steps": 10},
              "snapshot": {"durable": {"every_steps": 10}}, "log": {"plots": False, "progress_bar": False}}
    generator = torch.Generator().manual_seed(0)
    points = TensorDataset(torch.randn(512, 4, generator=generator), torch.randn(512, 1, generator=generator))
    with elastictrain.Session(config) as session:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        wrapped = session.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(points)
        session.restore()
        train(session, loader, wrapped, optimizer, mistake)


if __name__ == "__main__":
    main(*sys.argv[1:])
