"""How long a worker takes to end once its run is over: the interpreter's finalization, kept or skipped.

What it measures. ``python -m elastictrain train`` (one process, the embedded default task, ``train.max_steps``
steps) ends through ``cli.run``: it joins the program's non-daemon threads, runs the atexit handlers, flushes,
and leaves with ``os._exit``, skipping the interpreter's teardown of its modules (torch among them). The
``finalized`` mode runs the very same program as ``sys.exit(cli.main())``, which is what ended it before.
Each trial times, from the run summary line (printed at DONE, once everything is closed) to the process's
exit, and the whole run from launch. The modes alternate within each trial, so load drift on the machine
falls on both alike; the table gives medians and the paired differences.

Under torchrun every worker pays this at every exit and the agent waits for its slowest worker before it
restarts the group or ends the job.

    PYTHONPATH=. .venv/bin/python benchmarks/exit_time.py --trials 8
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

FINALIZED = "import sys; from elastictrain.cli import main as cli; sys.argv[0] = 'elastictrain'; sys.exit(cli.main())"


def one(mode: str, steps: int, workdir: pathlib.Path) -> dict:
    overrides = ["train", f"train.max_steps={steps}", f"run.dir={workdir}", "log.plots=false", "log.progress_bar=false",
                 "snapshot.durable.every_steps=0"]
    command = [sys.executable, "-m", "elastictrain", *overrides] if mode == "skipped" else \
        [sys.executable, "-c", FINALIZED, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    summary_at = None
    for line in proc.stdout:
        if "run summary:" in line:
            summary_at = time.monotonic()
    code = proc.wait()
    ended = time.monotonic()
    if code != 0 or summary_at is None:
        raise SystemExit(f"{mode}: exit code {code}, summary line {'seen' if summary_at else 'missing'}")
    return {"exit_s": ended - summary_at, "run_s": ended - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/exit_time.json")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"finalized": [], "skipped": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            order = ("finalized", "skipped") if trial % 2 == 0 else ("skipped", "finalized")
            for mode in order:
                results[mode].append(one(mode, args.steps, pathlib.Path(tmp) / f"{mode}-{trial}"))
    load.append(os.getloadavg()[0])
    paired = [f["exit_s"] - s["exit_s"] for f, s in zip(results["finalized"], results["skipped"])]
    table = {mode: {"exit_s_median": statistics.median(r["exit_s"] for r in runs),
                    "run_s_median": statistics.median(r["run_s"] for r in runs)} for mode, runs in results.items()}
    print("| mode | summary line -> exit, s (median) | launch -> exit, s (median) |")
    print("|---|---|---|")
    for mode, row in table.items():
        print(f"| {mode} | {row['exit_s_median']:.3f} | {row['run_s_median']:.2f} |")
    print(f"paired (finalized - skipped) exit time: median {statistics.median(paired):.3f} s, "
          f"min {min(paired):.3f}, max {max(paired):.3f}; {args.trials} trials; 1-min load {load[0]:.1f} -> {load[1]:.1f}")
    pathlib.Path(args.out).write_text(json.dumps({"trials": results, "medians": table, "paired_s": paired,
                                                  "load_1min": load, "steps": args.steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
