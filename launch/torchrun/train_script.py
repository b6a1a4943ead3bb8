import sys

import torch
import torch.nn.functional as F
from torch import nn

from elastictrain import Trainer, seed_everything
from elastictrain.train.tasks.spirals import make_spirals

seed_everything(0)  # the same initial weights in every run
model = nn.Sequential(
    nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 3)
)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)


def cosine(optimizer, total_steps):  # called once the world size, and so the step count, is known
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


def loss_fn(model, batch):
    points, labels = batch
    logits = model(points)
    return F.cross_entropy(logits, labels), {"accuracy": (logits.argmax(1) == labels).float().mean()}


trainer = Trainer(
    model, optimizer, make_spirals(4096, classes=3, noise=0.15, seed=1), loss_fn,
    val_data=make_spirals(1024, classes=3, noise=0.15, seed=2), lr_scheduler=cosine,
    config={"run": {"name": "my-script"}, "train": {"max_epochs": 10}},
    overrides=sys.argv[1:],  # e.g. snapshot.durable.url=s3://bucket/my-run train.max_epochs=20
)
summary = trainer.fit()
