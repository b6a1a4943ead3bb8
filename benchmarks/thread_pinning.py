"""What thread pinning costs: step time pinned (the default) against unpinned, at 1 and 2 workers.

"pinned" is elastictrain as shipped (``train.intra_op_threads=auto``: the count pinned, MKL's
deterministic scheduling ``MKL_CBWR=AUTO`` and no dynamic threads). "unpinned" is the runtime as it
comes: ``train.intra_op_threads=off`` and ``MKL_CBWR=`` (empty: MKL schedules dynamically; MKL reads ``OFF`` as AUTO). Both run the
step-overhead worker (benchmarks/_overhead_worker.py, snapshots off) under real torchrun, in
alternating order within each repetition, so load on the machine falls on both; the ratio is the
median of the paired pinned / unpinned step times. Neither sets OMP_NUM_THREADS: one worker gets
two threads, each of two workers one, as torchrun decides.

    PYTHONPATH=. .venv/bin/python benchmarks/thread_pinning.py --repeats 5
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
from tests.helpers import procs  # noqa: E402  (every process a job starts is reaped by pid)

WORKER = pathlib.Path(__file__).resolve().with_name("_overhead_worker.py")
MODES = {
    "pinned": ({}, {}),
    "unpinned": ({"train": {"intra_op_threads": "off"}}, {"MKL_CBWR": ""}),  # empty: MKL's default (CNR off)
}


def run_once(mode: str, nproc: int, model: str, steps: int, workdir: pathlib.Path) -> float:
    config, env = MODES[mode]
    out = workdir / f"{mode}-{nproc}-{model}-{time.time_ns()}.json"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", str(WORKER), "--mode=elastictrain", f"--model={model}",
               f"--steps={steps}", f"--out={out}", f"--run-dir={workdir / out.stem}"]
    child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_CBWR")}
    child_env.update({"OVERHEAD_CONFIG": json.dumps(config), "PYTHONPATH": str(REPO_ROOT), **env})
    job = procs.launch(command, log_path=workdir / f"{out.stem}.log", env=child_env, cwd=REPO_ROOT)
    try:
        code = job.wait(600)
    finally:
        job.kill_all()
    if code != 0 or not out.exists():
        raise RuntimeError(f"{mode} at {nproc} worker(s) on {model}: exit {code}; log in {job.log_path}")
    return json.loads(out.read_text())["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "thread_pinning.json"))
    args = parser.parse_args()
    steps = {"wide": 200, "tiny": 600}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        for nproc in (1, 2):
            for model, n in steps.items():
                times = {mode: [] for mode in MODES}
                for repeat in range(args.repeats):
                    for mode in (list(MODES) if repeat % 2 == 0 else list(reversed(MODES))):
                        times[mode].append(run_once(mode, nproc, model, n, workdir))
                ratios = [p / u for p, u in zip(times["pinned"], times["unpinned"], strict=True)]
                results[f"{nproc}w-{model}"] = {
                    "workers": nproc, "model": model,
                    **{f"{mode}_step_ms": [t * 1e3 for t in times[mode]] for mode in MODES},
                    "median_ratio": statistics.median(ratios),
                }
    print("| workers | model | pinned step ms (median) | unpinned step ms (median) | pinned / unpinned, median of pairs |")
    print("|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['workers']} | {r['model']} | {statistics.median(r['pinned_step_ms']):.3f} "
              f"| {statistics.median(r['unpinned_step_ms']):.3f} | {r['median_ratio']:.3f} |")
    pathlib.Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "repeats": args.repeats, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
