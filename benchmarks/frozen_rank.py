"""Measure how long a frozen rank holds up its group: SIGSTOP of a worker -> the restarted group restored.

Each trial runs the traced test job (tests/helpers/jobs.py) under real torchrun with 2 workers
and the watchdog's default settings (``hang_timeout_s`` 30, ``heartbeat_every_s`` 1). When rank
1 reaches step 37 it writes its pid; this script sends it SIGSTOP and times until the restarted
group logs ``INFO restored snapshot`` (the first start found none; with two agents the restart of the live node
may be torchrun's membership change, which keeps its restart count at 0, so the line's ``a1`` is not waited
for), then lets the run end and checks its params_sha256
against an unbroken run of the same job. The live rank's hang line (its millisecond timestamp) says
when detection ended. ``--burners N`` runs N CPU-bound processes (a Python busy
loop each) beside the job for the whole run; every trial records the load average at the SIGSTOP.
``--warm`` launches the job with warm restarts (``-m elastictrain.launcher.warmstart``). ``--nodes 2``
runs the frozen rank on another node: two torchrun agents on 127.0.0.1, one worker each (the shipped
``launch/torchrun/multi_node.sh``, ``elastictrain-c10d``, warm restarts, ``--rdzv-conf`` 2/1/4 whole
seconds: the frozen node stays in the round), so the live rank has no stopped process on its host to find and the frozen
node's own agent must stop its worker for the new rendezvous round.

    PYTHONPATH=. .venv/bin/python benchmarks/frozen_rank.py --trials 3 --out benchmarks/results/frozen_rank.json
    PYTHONPATH=. .venv/bin/python benchmarks/frozen_rank.py --nodes 2 --burners 6 --trials 3 \
        --out benchmarks/results/frozen_rank_nodes_loaded.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import signal
import statistics
import tempfile
import time

from tests.conftest import WARM, job_env, parse_job, torchrun_launcher
from tests.helpers import procs
from tests.helpers.agents import NodeGroup
from tests.helpers.jobs import JOB, TIMEOUT_S, run_reference

RDZV_CONF = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 4}  # whole seconds
HANG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \[elastictrain r\d a0\] ERROR rank \d: no progress", re.MULTILINE)


def line_unix(match: re.Match, near_unix: float) -> float:
    day = datetime.datetime.fromtimestamp(near_unix)
    hours, minutes, seconds, millis = (int(group) for group in match.groups())
    return day.replace(hour=hours, minute=minutes, second=seconds, microsecond=millis * 1000).timestamp()


def trial(workdir: pathlib.Path, timeout_s: float, warm: bool) -> tuple[float, str, float, float | None]:
    (workdir / "trace").mkdir(parents=True)
    overrides = [*JOB, f"task.args.trace_dir={workdir / 'trace'}", f"run.dir={workdir / 'run'}",
                 "task.args.pause_rank=1", "task.args.pause_at_step=37"]
    job = procs.launch([*torchrun_launcher(), *(WARM if warm else []), "-m", "elastictrain", "train", *overrides],
                       log_path=workdir / "job.log",
                       env=job_env(), cwd=workdir)
    try:
        pid = int(procs.wait_for_file(workdir / "trace" / "paused-rank1.pid", TIMEOUT_S, job))
        os.kill(pid, signal.SIGSTOP)
        stopped_at, stopped_unix = time.monotonic(), time.time()
        load = os.getloadavg()[0]
        job.wait_for(lambda out: "INFO restored snapshot" in out, timeout_s, "the restarted group's restore")
        restart_s = time.monotonic() - stopped_at
        assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
        hang = HANG_LINE.search(job.output())
        detect_s = line_unix(hang, stopped_unix) - stopped_unix if hang else None
        return restart_s, parse_job(job.output()).summary["params_sha256"], load, detect_s
    finally:
        procs.kill_all_launched()


def trial_nodes(workdir: pathlib.Path, timeout_s: float) -> tuple[float, str, float, float | None]:
    """``trial`` with rank 1 alone on a second node (agent)."""
    (workdir / "trace").mkdir(parents=True)
    overrides = [*JOB, f"task.args.trace_dir={workdir / 'trace'}", f"run.dir={workdir / 'run'}",
                 "task.args.pause_rank=1", "task.args.pause_at_step=37"]
    nodes = NodeGroup(workdir, [*WARM, "-m", "elastictrain", "train", *overrides], nnodes="2", rdzv_conf=RDZV_CONF,
                      env={**job_env(), "RDZV_BACKEND": "elastictrain-c10d"})
    try:
        nodes.launch(0, host_store=True)
        nodes.launch(1, host_store=False)
        pid = int(procs.wait_for_file(workdir / "trace" / "paused-rank1.pid", TIMEOUT_S, nodes.agents[1]))
        os.kill(pid, signal.SIGSTOP)
        stopped_at, stopped_unix = time.monotonic(), time.time()
        load = os.getloadavg()[0]
        live = nodes.agents[0]
        live.wait_for(lambda out: "INFO restored snapshot" in out, timeout_s, "the restarted group's restore")
        restart_s = time.monotonic() - stopped_at
        codes = nodes.wait(TIMEOUT_S)
        assert set(codes.values()) == {0}, (codes, live.output()[-4000:])
        hang = HANG_LINE.search(live.output())
        detect_s = line_unix(hang, stopped_unix) - stopped_unix if hang else None
        return restart_s, parse_job(live.output()).summary["params_sha256"], load, detect_s
    finally:
        for agent in nodes.agents.values():
            agent.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--burners", type=int, default=0, help="CPU-bound processes beside the job")
    parser.add_argument("--warm", action="store_true", help="warm restarts (-m elastictrain.launcher.warmstart)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: the frozen rank on another node (two agents, warm restarts)")
    args = parser.parse_args()
    with procs.cpu_burners(args.burners):
        run(args)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "reference").mkdir()
        reference = run_reference(root / "reference").result.summary["params_sha256"]
        results = []
        for index in range(args.trials):
            restart_s, sha, load, detect_s = (
                trial_nodes(root / f"trial{index}", args.timeout_s) if args.nodes == 2
                else trial(root / f"trial{index}", args.timeout_s, args.warm))
            results.append({"restart_s": round(restart_s, 2), "detect_s": detect_s and round(detect_s, 2),
                            "bitwise": sha == reference, "load_at_sigstop": load})
            print(f"trial {index}: SIGSTOP -> restarted group restored in {restart_s:.1f} s (the live rank's hang line "
                  f"after {detect_s} s), bitwise={sha == reference}, load average {load:.1f}",
                  flush=True)
    summary = {"burners": args.burners, "warm": args.warm or args.nodes == 2, "nodes": args.nodes, "trials": results, "median_restart_s": round(statistics.median(r["restart_s"] for r in results), 2)}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
