"""What one fast-tier copy costs training, written while training waits or in the background.

Each run is a real 2-worker ``torchrun`` job of ``_goodput_worker.py`` (goodput.py's model: 4 x
(Linear(1024, 1024) + ReLU) + Linear(1024, 10), AdamW: a ~50 MB snapshot; 32 samples per rank),
``--steps`` steps with no fault, in one of three modes, rotated within every repeat:

- ``none``: no fast tier (the one durable snapshot at the end, after the last step);
- ``sync``: a fast copy under /dev/shm every ``--every`` steps, written while training waits
  (``snapshot.local.async_write=false``);
- ``async``: the same, staged into reused buffers and written in a background thread
  (``snapshot.local.async_write=true``).

Cost per copy = (the job's step time summed, less the ``none`` run's of the same repeat) over the
copies taken: the span from the 21st step's forward to the last one's, so the wait for the copy
and whatever a background write takes from the steps around it both count. Training's wait per
copy (rank 0's LOCAL_SNAPSHOT state) and the commit's own duration are reported beside it.
On two busy cores the step time moves by several per cent from run to run: a copy every 2 steps
puts ~240 copies in a run, which is what lets a few milliseconds show.

    PYTHONPATH=. .venv/bin/python benchmarks/fast_copy_cost.py --repeats 3
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

from benchmarks import _goodput_timeline as timeline_of
from benchmarks.goodput import Job, load_average, run_job, uptime

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = ("none", "sync", "async")


def job_for(mode: str, args: argparse.Namespace, fast_url: str) -> Job:
    snapshot = {"durable": {"every_steps": 0}}
    if mode != "none":
        snapshot["local"] = {"url": fast_url, "every_steps": args.every, "async_write": mode == "async"}
    return Job(mode, "elastictrain", faulted=False, epochs=1, epoch_steps=args.steps, config={"snapshot": snapshot},
               fast_tier_url=None if mode == "none" else f"{fast_url}/goodput")


def measure(raw: dict) -> dict:
    timeline = raw["timeline"]
    attempt = timeline.attempts[0]
    intervals = [seconds for _, seconds in timeline_of.step_intervals(attempt)[20:]]
    last_step = attempt.steps[-1][0]
    copies = [seconds for step, seconds in attempt.snapshots if step < last_step]  # not the final durable one
    commits = [commit["seconds"] for commit in timeline.commits if commit["tier"] == "node-local"]
    return {
        "mode": raw["job"], "repeat": raw["repeat"], "outcome": raw["outcome"],
        "steps_timed": len(intervals), "steps_s": round(sum(intervals), 3),
        "step_ms_median": round(statistics.median(intervals) * 1e3, 2),
        "copies": len(copies),
        "blocked_ms_median": round(statistics.median(copies) * 1e3, 1) if copies else None,
        "commit_ms_median": round(statistics.median(commits) * 1e3, 1) if commits else None,
        "load_at_start": raw["load_at_start"], "load_at_end": raw["load_at_end"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=2, help="snapshot.local.every_steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fast-dir", default="/dev/shm")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "fast_copy_cost.json")
    args = parser.parse_args()
    # What goodput.run_job reads of its arguments; no job here is faulted.
    run_args = argparse.Namespace(seed=0, kill_every=0.0, job_timeout_s=600.0, keep_logs=None)
    started, uptime_at_start = time.time(), uptime()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fast-copy-cost-") as scratch:
        for repeat in range(args.repeats):
            shift = repeat % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                fast_url = f"{args.fast_dir.rstrip('/')}/elastictrain-fast-copy-{os.getpid()}-{repeat}-{mode}"
                raw = run_job(job_for(mode, args, fast_url), repeat, pathlib.Path(scratch), run_args, mode)
                runs.append(measure(raw))
                print(f"  {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    summary = {}
    for mode in ("sync", "async"):
        costs = []
        for repeat in range(args.repeats):
            base = next(r for r in runs if r["repeat"] == repeat and r["mode"] == "none")
            run = next(r for r in runs if r["repeat"] == repeat and r["mode"] == mode)
            if run["copies"]:
                costs.append((run["steps_s"] - base["steps_s"]) / run["copies"] * 1e3)
        of_mode = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            "cost_per_copy_ms_by_repeat": [round(cost, 1) for cost in costs],
            "cost_per_copy_ms_median": round(statistics.median(costs), 1) if costs else None,
            "blocked_ms_median": statistics.median(r["blocked_ms_median"] for r in of_mode),
            "commit_ms_median": statistics.median(r["commit_ms_median"] for r in of_mode),
        }
    result = {
        "benchmark": "fast_copy_cost", "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "started_unix_s": round(started, 1), "total_wall_s": round(time.time() - started, 1),
        "uptime_at_start": uptime_at_start, "uptime_at_end": uptime(), "load_at_end": load_average(),
        "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "settings": {"steps": args.steps, "every": args.every, "repeats": args.repeats, "fast_dir": args.fast_dir,
                     "world_size": 2, "model": "4 x (Linear(1024, 1024) + ReLU) + Linear(1024, 10), AdamW"},
        "summary": summary, "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
