"""Step time with the experiment trackers on (TensorBoard, MLflow on a real server) against off.

Each repetition runs the three modes under real ``torchrun --nproc-per-node=2`` (gloo, CPU), in rotating
order, on the step-overhead benchmark's worker (benchmarks/_overhead_worker.py, the Trainer): the same
model, data, batch and steps, metrics every 10 steps and a durable snapshot every 20 steps in every mode
(the trackers write at each committed snapshot). Reported: the median step time of each mode and the
median over repetitions of on / off.

    PYTHONPATH=. .venv/bin/python benchmarks/tracking.py --repeats 5
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
from step_overhead import run_job  # noqa: E402  (launch, wait for the result, reap)
from tests.helpers.mlflow_server import MlflowServer  # noqa: E402  (a real server on 127.0.0.1, stopped by pid)

WORKER = pathlib.Path(__file__).resolve().with_name("_overhead_worker.py")
COMMON = {"train": {"log_every_steps": 10},
          "snapshot": {"durable": {"every_steps": 20, "on_done": False, "lease_stale_after_s": 0}}}


def modes(mlflow_uri: str) -> dict[str, dict]:
    return {"off": {}, "tensorboard": {"track": {"tensorboard": True}},
            "mlflow": {"track": {"mlflow_uri": mlflow_uri}}}


def run_once(mode: str, config: dict, model: str, steps: int, workdir: pathlib.Path) -> float:
    out = workdir / f"{mode}-{model}-{time.time_ns()}.json"
    run_dir = workdir / out.stem  # a fresh run each time: no snapshot to resume, a TensorBoard directory of its own
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", str(WORKER), "--mode=elastictrain", f"--model={model}",
               f"--steps={steps}", f"--out={out}", f"--run-dir={run_dir}"]
    env = {**os.environ, "OVERHEAD_CONFIG": json.dumps({**COMMON, **config}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return run_job(command, env, out, f"{mode} on {model}", workdir)["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=("tiny", "wide"), default="tiny")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "tracking.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        server = MlflowServer(workdir)
        try:
            configs = modes(server.uri)
            times = {mode: [] for mode in configs}
            for repeat in range(args.repeats):
                names = list(configs)
                for mode in names[repeat % len(names):] + names[:repeat % len(names)]:  # rotate the order
                    times[mode].append(run_once(mode, configs[mode], args.model, args.steps, workdir))
                    print(f"repeat {repeat} {mode}: {times[mode][-1] * 1e3:.3f} ms a step", flush=True)
        finally:
            server.stop()
    load_at_end = os.getloadavg()
    results = {f"{mode}_step_ms": [t * 1e3 for t in values] for mode, values in times.items()}
    for mode in ("tensorboard", "mlflow"):
        results[f"{mode}_median_ratio"] = statistics.median(on / off for on, off in zip(times[mode], times["off"], strict=True))
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.1f}' for x in load_at_start)} at start, "
          f"{' '.join(f'{x:.1f}' for x in load_at_end)} at the end")
    print("| model | steps | off: step ms (median) | tensorboard: step ms | on / off | mlflow: step ms | on / off |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.steps} | {statistics.median(results['off_step_ms']):.3f} "
          f"| {statistics.median(results['tensorboard_step_ms']):.3f} | {results['tensorboard_median_ratio']:.3f} "
          f"| {statistics.median(results['mlflow_step_ms']):.3f} | {results['mlflow_median_ratio']:.3f} |")
    pathlib.Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats, "model": args.model,
        "steps": args.steps, "load_average_start": load_at_start, "load_average_end": load_at_end, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
