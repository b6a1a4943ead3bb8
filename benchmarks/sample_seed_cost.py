"""Cost per sample of seeding augmentation from the sample (elastictrain/data/sample_seeds.py).

Times the fetch of batches of trivial samples (a 2-float tensor, no augmentation) plain and
through ``SeededSamples``, as the DataLoader does (``__getitems__``): in a DataLoader worker (the
global RNGs seeded per sample, nothing to put back) and in the training process
(``num_workers=0``: the streams also saved and put back once per batch). Results are per sample,
for batches of 1 and 16. One process, one intra-op thread; the median of ``--repeats`` runs of
``--samples`` samples each.

    PYTHONPATH=. .venv/bin/python benchmarks/sample_seed_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import time
from unittest import mock

import numpy as np
import torch

from elastictrain.data import sample_seeds
from elastictrain.data.sample_seeds import SeededSamples, sample_seed

RESULT = pathlib.Path(__file__).resolve().parent / "results" / "sample_seed_cost.json"


class Trivial(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = torch.zeros(1, 2)

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[0]


def per_sample_us(fetch, batch: int, samples: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for first in range(0, samples, batch):
            fetch(list(range(first, first + batch)))
        runs.append((time.perf_counter() - started) / samples * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain, seeded = Trivial(), SeededSamples(Trivial(), seed=0)
    n, r = args.samples, args.repeats
    results = {}
    for batch in (1, 16):
        base = per_sample_us(lambda indices: [plain[i] for i in indices], batch, n, r)
        training = per_sample_us(seeded.__getitems__, batch, n, r)
        with mock.patch.object(sample_seeds, "get_worker_info", lambda: object()):  # as inside a worker
            worker = per_sample_us(seeded.__getitems__, batch, n, r)
        results[f"batch_{batch}"] = {"plain_us": base, "worker_us": worker, "training_process_us": training,
                                     "worker_overhead_us": worker - base, "training_process_overhead_us": training - base}
    one = lambda call: per_sample_us(lambda indices: [call(i) for i in indices], 16, n, r)  # noqa: E731
    results["parts_us"] = {
        "sample_seed": one(lambda i: sample_seed(7, i)),
        "seed_torch": one(lambda i: torch.default_generator.manual_seed(sample_seed(7, i))),
        "seed_random": one(lambda i: random.seed(sample_seed(7, i))),
        "seed_numpy": one(lambda i: np.random.seed(sample_seed(7, i) >> 32)),
        "save_and_restore_torch": one(lambda i: torch.set_rng_state(torch.get_rng_state())),
        "save_and_restore_random": one(lambda i: random.setstate(random.getstate())),
        "save_and_restore_numpy": one(lambda i: np.random.set_state(np.random.get_state())),
    }
    results = {group: {k: round(v, 2) for k, v in values.items()} for group, values in results.items()}
    results.update(samples=n, repeats=r, load_average_1min=os.getloadavg()[0], cpus=os.cpu_count(),
                   torch=torch.__version__, numpy=np.__version__, python=platform.python_version(),
                   machine=platform.machine())
    RESULT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
