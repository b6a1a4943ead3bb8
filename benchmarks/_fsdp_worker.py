"""One worker of the fsdp benchmark (benchmarks/fsdp.py): the same FSDP2 model, data and batch trained by a
hand-written FSDP2 loop (``hand``, ``hand_async``: with DCP ``async_save`` every ``--every`` steps) or by
elastictrain with ``dist.strategy=fsdp`` (``elastictrain``: snapshots off; ``elastictrain_snap``: a sharded
snapshot every ``--every`` steps; ``elastictrain_async``: the same with ``snapshot.durable.async_write``).

Rank 0 records a timestamp at every training forward (steady-state step time, as _overhead_worker.py) and
the training time each snapshot blocks: elastictrain's snapshot report duration (the whole synchronous save, or
with async_write the wait for the previous write plus the staging), or
for ``async_save`` the call itself plus the wait for the previous save before the next one starts.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

FEATURES = 1024


def model() -> nn.Module:
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(FEATURES, FEATURES), nn.ReLU())],
                         nn.Linear(FEATURES, 10))


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, FEATURES, generator=generator), torch.randint(0, 10, (samples,), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("hand", "hand_async", "elastictrain", "elastictrain_snap",
                                                        "elastictrain_async"), required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = args.steps * args.batch_size * world
    torch.manual_seed(0)
    net = model()
    stamps: list[float] = []
    blocked: list[float] = []

    def loss_fn(module, batch):
        stamps.append(time.perf_counter())
        inputs, labels = batch
        return F.cross_entropy(module(inputs), labels)

    if args.mode.startswith("hand"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in net:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        sampler = DistributedSampler(dataset(samples), shuffle=True, seed=0, drop_last=True)
        loader = DataLoader(sampler.dataset, batch_size=args.batch_size, sampler=sampler)
        pending = None
        # async_save's collectives run on a thread beside training's: a group of their own, as DCP's docs advise.
        save_group = dist.new_group(backend="gloo") if args.mode == "hand_async" else None
        for step, batch in enumerate(loader, 1):
            loss = loss_fn(net, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if args.mode == "hand_async" and step % args.every == 0:
                started = time.perf_counter()
                if pending is not None:
                    pending.result()  # one save in flight, as elastictrain's background writes
                model_state, optim_state = get_state_dict(net, [optimizer])
                pending = dcp.async_save({"model": model_state, "optim": optim_state},
                                         checkpoint_id=os.path.join(args.run_dir, f"step-{step}"),
                                         process_group=save_group)
                blocked.append(time.perf_counter() - started)
        if pending is not None:
            pending.result()
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        from elastictrain import Trainer
        from elastictrain.core.events import Observer

        class Blocked(Observer):
            def snapshotted(self, report) -> None:
                blocked.append(report.duration_s)

        every = args.every if args.mode != "elastictrain" else 0
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)  # rebound to the sharded parameters by register
        config = {
            "run": {"dir": args.run_dir},
            "dist": {"strategy": "fsdp"},
            "train": {"max_epochs": 1, "batch_size": args.batch_size, "log_every_steps": 50},
            "snapshot": {"durable": {"every_steps": every, "on_done": False, "lease_stale_after_s": 0, "keep_last": 2,
                                      "async_write": args.mode == "elastictrain_async"}},
            "anomaly": {"policy": "off"},
            "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
        }
        trainer = Trainer(net, optimizer, dataset(samples), loss_fn, config=config, observers=[Blocked()])
        trainer.fit()
        rank = trainer.session.rank
    if rank == 0:
        span = stamps[-1] - stamps[args.warmup]
        with open(args.out, "w") as out:
            json.dump({"step_s": span / (len(stamps) - 1 - args.warmup), "steps": len(stamps), "blocked_s": blocked}, out)


if __name__ == "__main__":
    main()
