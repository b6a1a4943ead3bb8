"""A custom loop with what real loops carry: gradient accumulation, an LR scheduler, clipping, autocast and an EMA.

    torchrun --nproc-per-node=2 examples/accumulation.py [key=value overrides, e.g. train.autocast_dtype=bfloat16]

Each optimizer step takes ``session.grad_accum_steps`` micro-batches (train.grad_accum_steps; after a
restart at another world size, what the elastic batch policy chose). DDP all-reduces the gradients
once per step: every micro-batch but the last runs under ``no_sync``. The forward runs under
``session.autocast()`` (train.autocast_dtype); ``session.gradients_ok()`` checks the step's gradients
and clips them to train.clip_grad_norm; the scheduler steps once per optimizer step; the EMA of the
weights follows every update taken. The loss and the accuracy of each micro-batch are logged weighted
by its samples (``train_loss``, ``train_accuracy`` in the run's history). Everything that changes
during training is registered: the model, the optimizer, the scheduler and the EMA.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

from elastictrain.train.session import Session

CONFIG = {
    "run": {"name": "accumulation"},
    "train": {"max_epochs": 4, "batch_size": 16, "grad_accum_steps": 2, "log_every_steps": 4, "clip_grad_norm": 1.0},
    "snapshot": {"durable": {"every_steps": 5}},
}


def blobs(samples: int, features: int = 16, classes: int = 4) -> TensorDataset:
    """Points around ``classes`` random centres (fixed by one seed, the same on every rank), labelled by centre."""
    generator = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return TensorDataset(centres[labels] + torch.randn(samples, features, generator=generator), labels)


def main(overrides: list[str]) -> None:
    with Session(CONFIG, overrides) as session:  # seeds torch from run.seed: the same initial weights on every rank
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=20)  # a warm-up
        ddp = session.wrap(model)  # the model on session.device (DDP when there are several workers)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))  # a copy of the weights, averaged below
        session.register(model=model, ema=ema, optimizer=optimizer, scheduler=scheduler)
        loader = session.loader(blobs(1024))
        session.restore()

        for _epoch in session.epochs():
            for batches in loader.steps():  # one optimizer step's micro-batches
                for micro, (inputs, labels) in enumerate(batches):
                    last = micro == len(batches) - 1
                    # All-reduce the gradients on the last micro-batch only (no DDP in a one-process run). A model
                    # wrapped with a loss_fn (session.wrap(model, loss_fn)) would train with StepRunner instead.
                    with ddp.no_sync() if hasattr(ddp, "no_sync") and not last else nullcontext():
                        with session.autocast():  # train.autocast_dtype (none: full precision)
                            logits = ddp(inputs)
                            loss = F.cross_entropy(logits.float(), labels)
                        (loss / len(batches)).backward()
                    accuracy = (logits.argmax(dim=1) == labels).float().mean()
                    session.log(len(labels), loss=loss.detach(), accuracy=accuracy)
                if session.gradients_ok():  # the logged losses and the gradients pass (anomaly.*), alike on every rank
                    optimizer.step()
                    ema.update_parameters(model)
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                session.step()


if __name__ == "__main__":
    main(sys.argv[1:])
