"""A custom loop on the Session with its own backward and ``session.gradients_ok()``, for the self-healing tests.

    torchrun --nproc-per-node=2 tests/helpers/healing_loop.py [key=value overrides]

``HEAL_POISON=<index>`` makes that training sample NaN; ``HEAL_FAULT=<step>:<rank>:<dir>`` sets one gradient
element to inf on that rank after the backward (after DDP's all-reduce) at that step, once per job (a marker
in <dir>): a hardware fault on one rank, which the ranks' gradients no longer agree on. Several faults:
comma-separated. At the end each rank prints ``rank R held steps [...]``: the steps whose update
``gradients_ok`` held on that rank (which must be every rank's) and its parameters' hash.
``HEAL_RAW_FROM=<step>`` calls the module itself instead of its DDP wrapper from that step on: each rank then
trains its own copy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.train.session import Session

CONFIG = {
    "run": {"name": "healing-loop"},
    "train": {"max_epochs": 2, "batch_size": 16, "log_every_steps": 4},
    "snapshot": {"durable": {"every_steps": 5}},
    "log": {"plots": False},
}


def blobs(samples: int = 512, poison: int = -1) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(4, 16, generator=generator)
    labels = torch.randint(0, 4, (samples,), generator=generator)
    inputs = centres[labels] + torch.randn(samples, 16, generator=generator)
    if poison >= 0:
        inputs[poison] = float("nan")
    return TensorDataset(inputs, labels)


def main(overrides: list[str]) -> None:
    faults = {}  # step -> (rank, marker)
    for fault in filter(None, os.environ.get("HEAL_FAULT", "").split(",")):
        step, rank, directory = fault.split(":")
        faults[int(step)] = (rank, Path(directory) / f"fault-{step}.done")
    held = []
    raw_from = int(os.environ.get("HEAL_RAW_FROM", "0")) or None
    with Session(CONFIG, overrides) as session:
        torch.manual_seed(session.config.run.seed)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ddp = session.wrap(model)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(blobs(poison=int(os.environ.get("HEAL_POISON", "-1"))))
        session.restore()
        for _epoch in session.epochs():
            for inputs, labels in loader:
                step = session.global_step + 1
                loss = F.cross_entropy((model if raw_from is not None and step >= raw_from else ddp)(inputs), labels)
                loss.backward()
                rank, marker = faults.get(step, ("", None))
                if str(session.rank) == rank and not marker.exists():
                    marker.write_text(str(step))
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
                if session.gradients_ok(loss=loss.detach()):
                    optimizer.step()
                else:
                    held.append(step)
                optimizer.zero_grad(set_to_none=True)
                session.step(loss=loss.detach())
    print(f"rank {session.rank} held steps {held} params_sha256={session.summary.params_sha256}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
