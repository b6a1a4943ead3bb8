"""One worker of the step-overhead benchmark: the same model, data and batch trained by a
textbook DDP loop (``hand``), by elastictrain's ``Trainer`` (``elastictrain``) or by a custom loop on
``Session`` (``session``), with the config step_overhead.py passes in ``OVERHEAD_CONFIG``.

Both record a timestamp at every training forward on rank 0; the steady-state step time is the
span between the forward of step ``--warmup`` and the last one, divided by the steps between.
That span covers everything a step costs in each loop: data, forward, backward, the gradient
all-reduce, the optimizer, and whatever the loop adds between steps (elastictrain's per-step
vote, metric sums, the preemption check).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

MODELS = {
    "wide": lambda: nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 10)),
    "tiny": lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
    # issue 52's small model: 4xLinear(64), trained with SGD at batch 64 per rank (benchmarks/step_overhead.py)
    "small": lambda: nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 10)),
}
FEATURES = {"wide": 1024, "tiny": 32, "small": 64}


def dataset(model: str, samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, FEATURES[model], generator=generator),
                         torch.randint(0, 10, (samples,), generator=generator))


def merged(base: dict, values: dict) -> dict:
    """``values`` over ``base``, nested sections merged key by key."""
    out = dict(base)
    for key, value in values.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("hand", "elastictrain", "session"), required=True)
    parser.add_argument("--model", choices=tuple(MODELS), required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = args.steps * args.batch_size * world
    torch.manual_seed(0)
    model = MODELS[args.model]()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2) if args.model == "small" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    stamps: list[float] = []
    snapshots: list[tuple[str, int]] = []  # (tier, step) of each committed snapshot, rank 0's record

    cpu: list[float] = []  # this process's CPU seconds (every thread) at each stamp
    full_collections: list[tuple[float, float]] = []  # (start, seconds) of each of the collector's full passes
    started: list[float] = [0.0]

    def collector(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            full_collections.append((started[0], time.perf_counter() - started[0]))

    gc.callbacks.append(collector)

    def loss_fn(module, batch):
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        inputs, labels = batch
        return F.cross_entropy(module(inputs), labels)

    if args.mode == "hand":
        dist.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(dataset(args.model, samples), shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(sampler.dataset, batch_size=args.batch_size, sampler=sampler)
        for batch in loader:
            loss = loss_fn(ddp, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        from elastictrain import Trainer
        from elastictrain.core.events import Observer
        from elastictrain.train.session import Session

        class Count(Observer):
            def snapshotted(self, report):
                if report.committed:
                    snapshots.append((str(report.tier), report.step))

        config = {
            "run": {"dir": args.run_dir},
            "train": {"max_epochs": 1, "batch_size": args.batch_size, "log_every_steps": 50},
            "snapshot": {"durable": {"every_steps": 0, "on_done": False, "lease_stale_after_s": 0}},
            "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
        }
        for section, values in json.loads(os.environ.get("OVERHEAD_CONFIG", "{}")).items():
            config[section] = merged(config.get(section, {}), values)
        if args.mode == "elastictrain":
            trainer = Trainer(model, optimizer, dataset(args.model, samples), loss_fn, config=config, observers=[Count()])
            trainer.fit()
            rank = trainer.session.rank
        else:  # a custom loop on Session, written as its docs say: gradients_ok before each update
            with Session(config, observers=[Count()]) as session:
                ddp = session.wrap(model)
                session.register(model=model, optimizer=optimizer)
                loader = session.loader(dataset(args.model, samples))
                session.restore()
                for _epoch in session.epochs():
                    for batch in loader:
                        loss = loss_fn(ddp, batch)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        if session.gradients_ok(loss=loss):
                            optimizer.step()
                        session.step(loss=loss)
                rank = session.rank
    if rank == 0:
        span = stamps[-1] - stamps[args.warmup]
        with open(args.out, "w") as out:
            timed = [tier for tier, step in snapshots if step > args.warmup]  # in the span timed
            steps = sorted(b - a for a, b in zip(stamps[args.warmup:], stamps[args.warmup + 1:]))
            json.dump({"step_s": span / (len(stamps) - 1 - args.warmup), "steps": len(stamps),
                       "median_step_s": steps[len(steps) // 2],
                       "cpu_step_s": (cpu[-1] - cpu[args.warmup]) / (len(cpu) - 1 - args.warmup),
                       "snapshots_timed": {tier: timed.count(tier) for tier in sorted(set(timed))},
                       # the collector's full passes in the span timed: (count, seconds in them)
                       "full_collections": [sum(1 for at, _ in full_collections if at > stamps[args.warmup]),
                                            sum(s for at, s in full_collections if at > stamps[args.warmup])]}, out)


if __name__ == "__main__":
    if os.environ.get("STEP_PROFILE"):  # a directory: each rank's cProfile of its whole run, rank<N>.prof
        import cProfile

        profile = cProfile.Profile()
        profile.runcall(main)
        profile.dump_stats(os.path.join(os.environ["STEP_PROFILE"], f"rank{os.environ.get('RANK', '0')}.prof"))
    else:
        main()
