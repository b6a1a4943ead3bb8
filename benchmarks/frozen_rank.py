"""Measure how long a frozen rank holds up its group: SIGSTOP of a worker -> the restarted group restored.

Each trial runs the traced test job (tests/helpers/jobs.py) under real torchrun with 2 workers
and the watchdog's default settings (``hang_timeout_s`` 30, ``heartbeat_every_s`` 1). When rank
1 reaches step 37 it writes its pid; this script sends it SIGSTOP and times until the restarted
group logs ``a1] INFO restored snapshot``, then lets the run end and checks its params_sha256
against an unbroken run of the same job.

    PYTHONPATH=. .venv/bin/python benchmarks/frozen_rank.py --trials 3 --out benchmarks/results/frozen_rank.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import tempfile
import time

from tests.conftest import job_env, parse_job, torchrun_launcher
from tests.helpers import procs
from tests.helpers.jobs import JOB, TIMEOUT_S, run_reference


def trial(workdir: pathlib.Path, timeout_s: float) -> tuple[float, str]:
    (workdir / "trace").mkdir(parents=True)
    overrides = [*JOB, f"task.args.trace_dir={workdir / 'trace'}", f"run.dir={workdir / 'run'}",
                 "task.args.pause_rank=1", "task.args.pause_at_step=37"]
    job = procs.launch([*torchrun_launcher(), "-m", "elastictrain", "train", *overrides], log_path=workdir / "job.log",
                       env=job_env(), cwd=workdir)
    try:
        pid = int(procs.wait_for_file(workdir / "trace" / "paused-rank1.pid", TIMEOUT_S, job))
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        job.wait_for(lambda out: "a1] INFO restored snapshot" in out, timeout_s, "the restarted group's restore")
        restart_s = time.monotonic() - stopped_at
        assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
        return restart_s, parse_job(job.output()).summary["params_sha256"]
    finally:
        procs.kill_all_launched()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "reference").mkdir()
        reference = run_reference(root / "reference").result.summary["params_sha256"]
        results = []
        for index in range(args.trials):
            restart_s, sha = trial(root / f"trial{index}", args.timeout_s)
            results.append({"restart_s": round(restart_s, 2), "bitwise": sha == reference})
            print(f"trial {index}: SIGSTOP -> restarted group restored in {restart_s:.1f} s, bitwise={sha == reference}",
                  flush=True)
    summary = {"trials": results, "median_restart_s": round(statistics.median(r["restart_s"] for r in results), 2)}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
