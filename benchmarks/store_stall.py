"""The torchrun agent, and the store it hosts, stalled (SIGSTOP) mid-run: what training loses.

Each trial starts the default job longer (60 epochs, 7,680 steps, 2 workers, ``--rdzv-backend=c10d``: the
agent hosts the workers' store, which the watchdog's heartbeats and rank 0's goodput counter write), SIGSTOPs
the agent once it is training, SIGCONTs it ``--stall-s`` later, and reads rank 0's step log lines (every 20
steps, millisecond stamps): the longest gap between two of them during the stall against the longest outside
it, and the steps trained during the stall against the same span right after it. A stalled store must not stall
training, and a stopped agent must not pass for an exited one (``core/signals.py``: the kernel signals the
workers only when it exits). ``--burners N`` runs N CPU-bound processes beside the job.

    PYTHONPATH=. .venv/bin/python benchmarks/store_stall.py --trials 2 --out benchmarks/results/store_stall_quiet.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

from tests.helpers import procs
from tests.helpers.chaos import STEP_LINE, step_times

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
JOB = ["train.max_epochs=60", "train.log_every_steps=20", "log.progress_bar=false", "log.plots=false"]


def trial(workdir: pathlib.Path, stall_s: float) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=0", "-m", "elastictrain", "train",
               f"run.dir={workdir}", *JOB]
    job = procs.launch(command, log_path=workdir / "job.log", env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
                       cwd=REPO_ROOT)
    try:
        job.wait_for(lambda out: len(STEP_LINE.findall(out)) >= 100, 300, "2,000 steps trained")
        load = os.getloadavg()[0]
        stopped = time.time()
        os.kill(job.proc.pid, signal.SIGSTOP)
        time.sleep(stall_s)
        os.kill(job.proc.pid, signal.SIGCONT)
        resumed = time.time()
        code = job.wait(300)
    finally:
        procs.kill_all_launched()
    output = job.output()
    lines = step_times(output, datetime.date.fromtimestamp(stopped))
    gaps = [(b[0] - a[0], a[0], b[0]) for a, b in zip(lines, lines[1:], strict=False)]
    during = [gap for gap, start, end in gaps if end > stopped and start < resumed]
    outside = [gap for gap, start, end in gaps if end <= stopped or start >= resumed]

    def steps_between(start: float, end: float) -> int:
        inside = [step for at, step in lines if start <= at <= end]
        return inside[-1] - inside[0] if len(inside) > 1 else 0

    return {"exit_code": code, "load": round(load, 2), "stall_s": round(resumed - stopped, 3),
            "longest_gap_during_s": round(max(during), 3), "longest_gap_outside_s": round(max(outside), 3),
            "steps_during_stall": steps_between(stopped, resumed),
            "steps_after_stall": steps_between(resumed, resumed + (resumed - stopped)),
            "done": "state=DONE step=7680" in output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--stall-s", type=float, default=8.0)
    parser.add_argument("--burners", type=int, default=0, help="CPU-bound processes beside the job")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    with procs.cpu_burners(args.burners):
        trials = []
        for index in range(args.trials):
            with tempfile.TemporaryDirectory() as scratch:
                trials.append(trial(pathlib.Path(scratch), args.stall_s))
            print(f"trial {index + 1}: {trials[-1]}", flush=True)
    keys = ("longest_gap_during_s", "longest_gap_outside_s", "steps_during_stall", "steps_after_stall")
    result = {"command": " ".join(sys.argv), "trials": trials,
              "median": {key: statistics.median(t[key] for t in trials) for key in keys}}
    print(json.dumps(result["median"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
