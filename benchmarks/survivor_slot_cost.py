"""What survivor copies cost a step: one slot write per step, measured beside the step it rides on.

Every rank writes its slot (``SurvivorCopies.mark``: RNG states, stream positions, metric sums
since the last reduce, pickled into one of two alternating files in ``--dir``) once per step and
after each metric reduce. This times ``mark`` alone, with 25 steps of two metrics pending (the
default log interval's worst case), and, interleaved with it in the same run, one training step
of goodput.py's model (4 x Linear(1024, 1024) + ReLU, Linear(1024, 10), AdamW, batch 32, one
process, one intra-op thread), so the ratio is of two things measured side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/survivor_slot_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import torch

from benchmarks._goodput_worker import build_model
from elastictrain.core.config_load import load_config
from elastictrain.dist.group import DistContext
from elastictrain.launcher.launch_env import LaunchEnv
from elastictrain.dist.reduce import WeightedSums
from elastictrain.core.progress import History, Progress
from elastictrain.snapshot.local_tier import LocalTier
from elastictrain.snapshot.survivor import SurvivorCopies

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm", help="where the fast tier (and so the slots) live")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of marks and steps")
    parser.add_argument("--marks", type=int, default=2000, help="marks timed per round")
    parser.add_argument("--steps", type=int, default=40, help="training steps timed per round")
    parser.add_argument("--out", default="benchmarks/results/survivor_slot_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 1024), torch.randint(0, 10, (32,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        cfg = load_config(None, [f"snapshot.local.url={root}"])
        ctx = DistContext(LaunchEnv("torchrun", rank=0, local_rank=0, world_size=2), True, CPU, "gloo", 60.0, round_id="r")
        progress, history, sums = Progress(), History(), WeightedSums(CPU)
        fast = LocalTier(cfg, ctx, model, {"progress": progress, "history": history},
                         rank_statefuls={"train_sums": sums})
        copies = SurvivorCopies(fast, 2, "r", progress, history, fast.rank_state_now)
        copies.open()
        for _ in range(25):
            sums.add(32, {"loss": torch.tensor(1.0), "accuracy": torch.tensor(0.5)})
        for _ in range(5):
            step()  # warm-up: AdamW's state, allocator
        mark_us, step_ms = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for i in range(args.marks):
                progress.global_step = i
                copies.mark(CPU)
            mark_us.append((time.perf_counter() - started) / args.marks * 1e6)
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            step_ms.append((time.perf_counter() - started) / args.steps * 1e3)
        slot_bytes = max(os.path.getsize(p) for p in pathlib.Path(copies.slots.directory).glob("rank-0.*"))
        copies.close()

    result = {
        "benchmark": "survivor_slot_cost",
        "command": "python benchmarks/survivor_slot_cost.py",
        "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "dir": args.dir, "slot_bytes": slot_bytes,
        "mark_us_by_round": [round(v, 1) for v in mark_us],
        "step_ms_by_round": [round(v, 2) for v in step_ms],
        "mark_us_median": round(statistics.median(mark_us), 1),
        "step_ms_median": round(statistics.median(step_ms), 2),
        "mark_share_of_step": round(statistics.median(m / 1e3 / s for m, s in zip(mark_us, step_ms)), 5),
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"slot {slot_bytes} bytes; mark {result['mark_us_median']} us (rounds {result['mark_us_by_round']}); "
          f"step {result['step_ms_median']} ms (rounds {result['step_ms_by_round']}); "
          f"a mark is {100 * result['mark_share_of_step']:.2f} % of a step")


if __name__ == "__main__":
    main()
