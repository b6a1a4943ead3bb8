"""What ``snapshot.local.every_s=auto`` costs over a run's first minute, with and without the prior.

Each arm is one real ``python -m elastictrain train`` process (the default task, world size 1)
with the fast tier in a temporary directory under /dev/shm, ``snapshot.local.every_s=auto`` and no
step-count snapshots. After ``--seconds`` it gets SIGTERM: the preemption snapshot records the
goodput counters, whose ``snapshot`` cause is the time training spent in fast copies (plus that
one preemption snapshot, the same in every arm). Arms: ``snapshot.local.mtbf_prior_s`` = 0 (the
time trained so far stands in for the time between failures) and the default 3600.

    PYTHONPATH=. .venv/bin/python benchmarks/auto_cadence_first_minute.py --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastictrain.cli.snapshot_tools import open_store, show_document

FIRST_INTERVAL = re.compile(r"fast-tier copies every ([\d.]+) s from now on \(auto, Young/Daly: (\d+) ms a copy")


def run_arm(prior_s: float, seconds: float, work: Path) -> dict:
    run_dir = work / f"prior-{prior_s:g}"
    command = [sys.executable, "-m", "elastictrain", "train", f"run.dir={run_dir}", "train.max_epochs=100000",
               "snapshot.durable.every_steps=0", "snapshot.durable.keep_last=1", "log.plots=false", "train.log_every_steps=1000",
               f"snapshot.local.url={work / 'shm'}", f"run.name=prior-{prior_s:g}", "snapshot.local.every_s=auto",
               f"snapshot.local.mtbf_prior_s={prior_s}"]
    with open(run_dir.with_suffix(".log"), "wb") as log_file:
        job = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        time.sleep(seconds)
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    output = run_dir.with_suffix(".log").read_text()
    document = show_document(*open_store(str(run_dir / "snapshots"), {}), None)
    seconds_by_cause = document["goodput"]["seconds_by_cause"]
    total = sum(seconds_by_cause.values())
    first = FIRST_INTERVAL.search(output)
    return {
        "local_mtbf_prior_s": prior_s, "exit_code": code, "step": document["step"],
        "snapshot_s": round(seconds_by_cause["snapshot"], 3), "productive_s": round(seconds_by_cause["productive"], 3),
        "snapshot_fraction": round(seconds_by_cause["snapshot"] / total, 4) if total else None,
        "interval_after_first_copy_s": float(first.group(1)) if first else None,
        "first_copy_cost_ms": int(first.group(2)) if first else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", default="benchmarks/results/auto_cadence_first_minute.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as scratch:
        arms = [run_arm(prior_s, args.seconds, Path(scratch)) for prior_s in (0.0, 3600.0)]
    result = {"seconds": args.seconds, "cpus": os.cpu_count(), "arms": arms}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
