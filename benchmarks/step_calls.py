"""Python calls a step: a hand loop against a ``Session`` custom loop, counted, not timed.

A step's own work in the loop, counted by cProfile (every Python function and builtin called), which
does not move with the machine's load as step times do at a few milliseconds. One process, a world of
one, no model (the loss is a constant: no forward, backward or optimizer), 64 samples a batch of the
issue-52 data (64 features): what is left is the data loading and what the loop around it does. Each
loop runs ``--steps`` steps in a process of its own; only functions called at least once a step count.

    PYTHONPATH=. .venv/bin/python benchmarks/step_calls.py
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset


def loop(mode: str, steps: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 64, 64, generator=generator), torch.randint(0, 10, (steps * 64,)))
    loss = torch.tensor(1.0)
    profile = cProfile.Profile()
    if mode == "hand":
        profile.enable()
        for _batch in DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)):
            pass
        profile.disable()
    else:
        from elastictrain.train.session import Session

        model = torch.nn.Linear(64, 10)
        run_dir = tempfile.TemporaryDirectory()  # removed as the child exits
        config = {
            "run": {"dir": run_dir.name},
            "train": {"max_epochs": 1, "batch_size": 64, "log_every_steps": 50},
            "snapshot": {"durable": {"every_steps": 0, "on_done": False, "lease_stale_after_s": 0}},
            "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
            "dist": {"distributed": False},
        }
        with Session(config) as session:
            session.register(model=model)
            loader = session.loader(data)
            session.restore()
            profile.enable()
            for _epoch in session.epochs():
                for _batch in loader:
                    session.gradients_ok(loss=loss)
                    session.step(loss=loss)
            profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    per_step = [(calls, path) for (path, _, _), (_, calls, *_rest) in stats.items() if calls >= steps]
    return {
        "calls_a_step": sum(calls for calls, _ in per_step) / steps,
        "elastictrain_calls_a_step": sum(calls for calls, path in per_step if "elastictrain" in path) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--mode", choices=("hand", "session"), help=argparse.SUPPRESS)  # one loop, in a child
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(loop(args.mode, args.steps)))
        return
    for mode in ("hand", "session"):
        out = subprocess.run([sys.executable, __file__, f"--mode={mode}", f"--steps={args.steps}"],
                             capture_output=True, text=True, check=True).stdout
        counts = json.loads(out.strip().splitlines()[-1])
        print(f"{mode}: {counts['calls_a_step']:.0f} calls a step, {counts['elastictrain_calls_a_step']:.0f} in "
              "elastictrain's functions")


if __name__ == "__main__":
    main()
