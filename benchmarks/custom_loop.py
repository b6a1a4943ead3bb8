"""Step time of a custom loop on elastictrain's API against the same loop written by hand with plain DDP.

Each repetition runs both under real ``torchrun --nproc-per-node=2`` (gloo, CPU) as an interleaved
pair (the order alternates), the same model, data, batch and number of steps; snapshots are off
(snapshot.durable.every_steps=0, snapshot.durable.on_done=false), everything else the session does per step is on.
Reported: the median step time of each, and the median over pairs of session / hand (target <= 1.02).

    PYTHONPATH=. .venv/bin/python benchmarks/custom_loop.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from step_overhead import run_job  # noqa: E402  (this script's directory: launch, wait for the result, reap)

WORKER = pathlib.Path(__file__).resolve().with_name("_custom_loop_worker.py")
MODES = ("hand", "session")
STEPS = {"tiny": 600, "wide": 200}


def run_once(mode: str, model: str, steps: int, workdir: pathlib.Path) -> float:
    out = workdir / f"{mode}-{model}-{time.time_ns()}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", str(WORKER), f"--mode={mode}", f"--model={model}", f"--steps={steps}",
               f"--out={out}", f"--run-dir={workdir / 'run'}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return run_job(command, env, out, f"{mode} on {model}", workdir)  # the hand loop may hang at exit: see there


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", choices=tuple(STEPS), default=list(STEPS))
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "custom_loop.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        for model in args.models:
            times = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                for mode in MODES if repeat % 2 == 0 else reversed(MODES):  # interleaved pairs, the order alternating
                    times[mode].append(run_once(mode, model, STEPS[model], workdir))
                    print(f"{model} repeat {repeat} {mode}: {times[mode][-1] * 1e3:.3f} ms a step", flush=True)
            ratios = [s / h for s, h in zip(times["session"], times["hand"], strict=True)]
            results[model] = {"hand_step_ms": [t * 1e3 for t in times["hand"]],
                              "session_step_ms": [t * 1e3 for t in times["session"]],
                              "ratios": ratios, "median_ratio": statistics.median(ratios)}
    load_at_end = os.getloadavg()
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.1f}' for x in load_at_start)} at start, "
          f"{' '.join(f'{x:.1f}' for x in load_at_end)} at the end")
    print("| model | steps a run | hand step ms (median) | custom loop on the API, step ms (median) "
          "| median of paired ratios | pairs | target |")
    print("|---|---|---|---|---|---|---|")
    for model, r in results.items():
        print(f"| {model} | {STEPS[model]} | {statistics.median(r['hand_step_ms']):.3f} "
              f"| {statistics.median(r['session_step_ms']):.3f} | {r['median_ratio']:.3f} | {len(r['ratios'])} "
              f"| <= 1.02 {'met' if r['median_ratio'] <= 1.02 else 'NOT met'} |")
    pathlib.Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats,
        "load_average_start": load_at_start, "load_average_end": load_at_end, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
