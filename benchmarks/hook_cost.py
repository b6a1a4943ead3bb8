"""What a gradient hook per parameter costs a backward: none, one, or one on every tensor.

The straggler timer (elastictrain/dist/sync_timer.py) keeps one ``register_post_accumulate_grad_hook`` a step
instead of one per parameter. One process, one thread, a stack of ``Linear(16, 16)`` layers, batch 8: the median
of 350 backwards (after 50) per variant, the three run one after another in each of ``--rounds`` rounds; the cost
of the hooks is the median over rounds of each round's difference (paired: the machine's drift between rounds
cancels).

    PYTHONPATH=. .venv/bin/python benchmarks/hook_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def backward_us(layers: int, hooks: str) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    parameters, inputs, stamp = list(model.parameters()), torch.randn(8, 16), [0.0]

    def ready(parameter: torch.Tensor) -> None:
        stamp[0] = time.perf_counter()

    for parameter in {"none": [], "one": parameters[:1], "all": parameters}[hooks]:
        parameter.register_post_accumulate_grad_hook(ready)
    times = []
    for _ in range(400):
        started = time.perf_counter()
        model(inputs).sum().backward()
        times.append(time.perf_counter() - started)
        for parameter in parameters:
            parameter.grad = None
    return statistics.median(times[50:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| tensors | backward µs, no hook (median of rounds) | a hook on every tensor, less one hook: median of paired |")
    print("|---|---|---|")
    for layers in (5, 50, 150):
        rounds = [{hooks: backward_us(layers, hooks) for hooks in ("none", "one", "all")} for _ in range(args.rounds)]
        base = statistics.median(r["none"] for r in rounds)
        extra = statistics.median(r["all"] - r["one"] for r in rounds)
        print(f"| {2 * layers} | {base:.0f} | {extra:.0f} ({extra / (2 * layers - 1):.2f} a hook) |")

if __name__ == "__main__":
    main()
