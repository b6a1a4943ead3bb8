"""A small GAN on 2-D points, on elastictrain's custom-loop API: two models, two optimizers, D then G each step.

    torchrun --nproc-per-node=2 examples/gan.py [key=value overrides, e.g. train.max_epochs=20]

The generator learns to map noise onto eight Gaussians on a ring. Each step trains the discriminator
on a batch of real points and generated ones, then the generator through the discriminator. Both
models and both optimizers are registered: every snapshot holds them, and a restart or a relaunch
after preemption continues bitwise where the run was. The noise comes from torch's RNG, which the
session seeds per rank and keeps in every snapshot.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.train.session import Session

NOISE = 4
CONFIG = {
    "run": {"name": "gan"},
    "train": {"max_epochs": 4, "batch_size": 32},
    "snapshot": {"durable": {"every_steps": 5}},
}


def ring_of_gaussians(samples: int, modes: int = 8, radius: float = 2.0, spread: float = 0.05) -> TensorDataset:
    """Real points: ``modes`` Gaussians on a circle (fixed by one seed, the same on every rank)."""
    generator = torch.Generator().manual_seed(0)
    angles = torch.randint(0, modes, (samples,), generator=generator) * (2 * math.pi / modes)
    centres = radius * torch.stack([angles.cos(), angles.sin()], dim=1)
    return TensorDataset(centres + spread * torch.randn(samples, 2, generator=generator))


def mlp(inputs: int, outputs: int, hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
                         nn.Linear(hidden, outputs))


def main(overrides: list[str]) -> None:
    with Session(CONFIG, overrides) as session:
        generator, discriminator = mlp(NOISE, 2), mlp(2, 1)
        opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        G, D = session.wrap(generator), session.wrap(discriminator)
        session.register(generator=generator, discriminator=discriminator, opt_g=opt_g, opt_d=opt_d)
        loader = session.loader(ring_of_gaussians(1024))
        session.restore()

        bce = nn.BCEWithLogitsLoss()
        for _epoch in session.epochs():
            for (real,) in loader:
                n = real.shape[0]
                # D step. One forward of D for real and generated points together: DDP reduces the
                # gradients of one forward per backward. No graph through G (no_grad): G is not trained here.
                with torch.no_grad():
                    fake = G(torch.randn(n, NOISE, device=session.device))
                ones, zeros = torch.ones(n, 1, device=session.device), torch.zeros(n, 1, device=session.device)
                d_loss = bce(D(torch.cat([real, fake])), torch.cat([ones, zeros]))
                opt_d.zero_grad(set_to_none=True)
                d_loss.backward()
                # Not when this rank's loss or D's gradient norm is non-finite (self-healing: anomaly.*): a rollback follows.
                if session.gradients_ok(D, loss=d_loss.detach()):
                    opt_d.step()
                # G step: fool D. D's gradients computed on the way are dropped by the next D step's zero_grad.
                g_loss = bce(D(G(torch.randn(n, NOISE, device=session.device))), ones)
                opt_g.zero_grad(set_to_none=True)
                g_loss.backward()
                if session.gradients_ok(G, loss=g_loss.detach()):
                    opt_g.step()
                session.step(d_loss=d_loss.detach(), g_loss=g_loss.detach())


if __name__ == "__main__":
    main(sys.argv[1:])
