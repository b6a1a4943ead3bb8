"""A task whose snapshot is ~200 MB: a 16.7 M-parameter MLP with Adam (weights plus two moments).

Used by the benchmarks that need a realistic state size on a 2-core CPU machine; the data are
a few random batches, since the cost being measured is the snapshot, not learning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain import Task


def build(width: int = 4096, samples: int = 2048, features: int = 64) -> Task:
    torch.manual_seed(0)
    # 64*4096 + 4096*4096 + 4096*10 weights: 16.1 M, ~16.7 M with the input layer's bias terms
    model = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, features, generator=generator), torch.randint(0, 10, (samples,), generator=generator))

    def loss_fn(module, batch):
        inputs, labels = batch
        return F.cross_entropy(module(inputs), labels)

    return Task(model, torch.optim.Adam(model.parameters(), lr=1e-4), data, loss_fn)
