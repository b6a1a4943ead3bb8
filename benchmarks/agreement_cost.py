"""What agreeing on a step's update costs (update_check.py): one 1-element all-reduce a step.

Two gloo workers under real ``torchrun`` train the step-overhead job's models (``_overhead_worker.py``'s
tiny MLP and 4xLinear(1024)) under DDP, one intra-op thread each, in interleaved blocks of three kinds:
``none`` (no agreement), ``after`` (the all-reduce after the backward, as ``gradients_ok`` makes it) and
``ahead`` (started before the backward, waited for after it, as ``Trainer`` makes it when it reads no
gradient norm). Reported: the median step time of each kind and the median over blocks of each kind's
step time over ``none``'s.

    PYTHONPATH=. .venv/bin/python benchmarks/agreement_cost.py --blocks 20
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from _overhead_worker import MODELS, dataset  # noqa: E402  (the step-overhead job's models and data)

KINDS = ("none", "after", "ahead")
STEPS = {"tiny": 100, "wide": 10}  # steps a block


def worker(model_name: str, blocks: int, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = dataset(model_name, 32).tensors

    def step(kind: str) -> None:
        loss = F.cross_entropy(ddp(inputs), labels)
        flag = torch.tensor([int(not torch.isfinite(loss).item())], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True) if kind == "ahead" else None
        loss.backward()
        if kind == "ahead":
            work.wait()
        elif kind == "after":
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flag.item()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):
        step("none")
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for block in range(blocks):
        for kind in (KINDS if block % 2 == 0 else KINDS[::-1]):
            dist.barrier()  # every block starts together
            started = time.perf_counter()
            for _ in range(STEPS[model_name]):
                step(kind)
            times[kind].append((time.perf_counter() - started) / STEPS[model_name] * 1e3)
    if dist.get_rank() == 0:
        pathlib.Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "agreement_cost.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.blocks, args.tmp)
    results: dict = {"load_before": os.getloadavg()[0]}
    for model_name in args.models:
        tmp = pathlib.Path(args.out).with_suffix(f".{model_name}.tmp")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:0", __file__, f"--worker={model_name}", f"--blocks={args.blocks}",
                        f"--tmp={tmp}"], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times = json.loads(tmp.read_text())
        tmp.unlink()
        results[model_name] = {
            "step_ms": {kind: statistics.median(times[kind]) for kind in KINDS},
            "median_ratio": {kind: statistics.median(a / b for a, b in zip(times[kind], times["none"]))
                             for kind in KINDS[1:]},
            "blocks_ms": times,
        }
        print(model_name, json.dumps({k: results[model_name][k] for k in ("step_ms", "median_ratio")}), flush=True)
    results["load_after"] = os.getloadavg()[0]
    pathlib.Path(args.out).write_text(json.dumps({"torch": torch.__version__, "blocks": args.blocks,
                                                  "results": results}, indent=2))


if __name__ == "__main__":
    main()
