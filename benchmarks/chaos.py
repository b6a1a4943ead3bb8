"""Chaos soak: every kind of fault thrown at one two-node job for N minutes; nothing may be lost, and what each cost.

What it runs. ``tests/helpers/chaos.py`` (the suite's ``tests/test_chaos.py`` runs the same for two minutes):
two torchrun agents as two "nodes" on this machine (c10d, ``--nnodes=1:2``, one worker each) under
``-m elastictrain.launcher.warmstart --preload s3fs``, the durable tier on a SeaweedFS S3 server this script starts (every
``--durable-every-s``, written in the background), the fast tier on a tmpfs of its own per node (every
``--local-every-s``), ``train.virtual_shards=2``; the traced test task, each step sleeping 30 ms. A seeded
schedule throws about one fault every ``--every-s`` seconds of training at it, the kinds drawn from a shuffled bag
(every kind once before any twice): SIGKILL or SIGSTOP of a worker, SIGTERM of agent 1 (relaunched 10-30 s
later), agent 1 and its worker SIGKILLed (node loss, relaunched 10-30 s later), the S3 server SIGSTOPped 20-60 s,
the newest fast copy of every node corrupted (then a worker SIGKILLed so a restore must read it), node 0's
tier filled by a file for 5-15 s, a NaN batch (``ELASTICTRAIN_FAULT=grad-inf`` at about its scheduled step, self-healed; one per job). Faults
run one after another, each once the one before ended and both nodes train again. An unbroken two-worker
torchrun of the same training runs beside it: its parameters are what the job must end with, its median step
time is the reference of the goodput.

What it checks and prints: the final parameters equal to the unbroken run's, no process, warm-start server,
listening rendezvous port or /dev/shm file left, every fault in the log (``chaos.VISIBLE``), the goodput counters
by cause from the final snapshot; one table (faults by kind, survived, seen in the log, steps redone, seconds
lost), and JSON in ``benchmarks/results/chaos.json``. Seconds lost by a fault: from its start to the later of its
end and the job training beyond the step it had reached, less the new steps in that window times the job's
median step time. Goodput = steps x the unbroken run's median step time / wall time from launch to the agents'
exit; ``at own step`` uses the job's own median step time (the load of the unbroken run beside it apart).
``by_kind`` in the JSON: each kind's median seconds lost. ``--burners N`` runs N CPU-bound processes beside the job
and its unbroken twin from launch to the end (the loaded rows of docs/measurements.md).

    PYTHONPATH=. .venv/bin/python benchmarks/chaos.py --minutes 10 [--burners 6]

Needs root (it mounts two tmpfs) and SeaweedFS's ``weed`` (pyproject's test extra). Every process is SIGKILLed by
pid at the end, the tmpfs unmounted, the S3 server stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict

import torch

from tests.conftest import job_env, parse_job
from tests.helpers import chaos, procs
from tests.helpers.s3 import S3Server

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def median_step_s(output: str, day: datetime.date) -> float:
    steps = chaos.step_times(output, day)
    intervals = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in zip(steps, steps[1:]) if s1 > s0]
    return statistics.median(intervals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="the job's length in minutes of unbroken training")
    parser.add_argument("--step-s", type=float, default=0.041,
                        help="the expected step time (unbroken, 2 workers; 40.7 ms measured here): steps = minutes x 60 / "
                             "this. Longer than the real one, the job ends before the schedule does")
    parser.add_argument("--every-s", type=float, default=30.0, help="seconds of training between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--durable-every-s", type=float, default=8.0)
    parser.add_argument("--local-every-s", type=float, default=2.0)
    parser.add_argument("--burners", type=int, default=0,
                        help="CPU-bound processes beside the job and its unbroken twin, from launch to the end")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "chaos.json")
    args = parser.parse_args()

    steps = round(args.minutes * 60 / args.step_s)
    duration_s = args.minutes * 60
    faults = chaos.schedule(args.seed, duration_s=duration_s, every_s=args.every_s)
    uptime_at_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{steps} steps, {len(faults)} faults; load at start: {uptime_at_start}", file=sys.stderr, flush=True)
    with procs.cpu_burners(args.burners):
        result = run(args, steps, duration_s, faults, uptime_at_start)
    survived = result["agent_exit_codes"] == {0: 0, 1: 0} and result["final_step"] == str(steps)
    if not (survived and result["bitwise_equal"]) or result["leftovers"] or result["not_visible"]:
        sys.exit(1)


def run(args: argparse.Namespace, steps: int, duration_s: float, faults: list, uptime_at_start: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="chaos-") as scratch_name:
        scratch = pathlib.Path(scratch_name)
        (scratch / "s3").mkdir()
        s3 = S3Server(scratch / "s3")
        s3.start()
        try:
            bucket = s3.new_bucket()
            (scratch / "unbroken").mkdir()
            unbroken = procs.launch(chaos.unbroken_command(scratch / "unbroken", steps), log_path=scratch / "unbroken.log",
                                    env={**job_env(), **chaos.ENV}, cwd=scratch / "unbroken")
            # the NaN batch at about its scheduled time (seconds of training / the expected step time)
            nan_step = next(round(f.at_s / args.step_s) for f in faults if f.kind == "nan-batch")
            job = chaos.ChaosJob(scratch / "chaos", s3, bucket, steps=steps, nan_step=nan_step,
                                 local_every_s=args.local_every_s, durable_every_s=args.durable_every_s,
                                 timeout_s=duration_s * 4 + 300)
            try:
                job.start()
                job.run(faults)
            finally:
                job.stop()
            output = job.output()
            codes = {index: agent.proc.returncode for index, agent in job.nodes.agents.items()}
            unbroken_code = unbroken.wait(duration_s * 2 + 300)
            causes = chaos.goodput_by_cause(job.durable_url, s3.storage_options)
        finally:
            s3.stop()
        leftovers = job.leftovers()
        day = datetime.date.fromtimestamp(job.launch_unix)
        summary = parse_job(job.nodes.agents[0].output()).summary
        reference = parse_job(unbroken.output()).summary
        reference_step_s = median_step_s(unbroken.output(), day)
        own_step_s = median_step_s(output, day)
        costs = chaos.cost_of(job.applied, chaos.step_times(output, day))
        survived = codes == {0: 0, 1: 0} and summary["step"] == str(steps)
        for cost in costs:
            cost["survived"] = survived
        nan_faults = [f for f in faults if f.kind == "nan-batch"]
        costs += [{**asdict(f), "steps_redone": 0, "seconds_lost": round(causes["seconds_by_cause"]["rollback"], 2),
                   "survived": survived, "note": f"grad-inf at step {nan_step} (seconds: the goodput counter's rollback)"}
                  for f in nan_faults]
        visible = chaos.visible_counts(output)
        wall_s = job.end_unix - job.launch_unix
        result = {
            "benchmark": "chaos",
            "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
            "torch": torch.__version__, "python": platform.python_version(),
            "uptime_at_start": uptime_at_start,
            "uptime_at_end": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "settings": {**vars(args), "out": str(args.out), "steps": steps, "train": chaos.TRAIN,
                         "tmpfs_size": chaos.TMPFS_SIZE},
            "agent_exit_codes": codes, "unbroken_exit_code": unbroken_code,
            "final_step": summary.get("step"), "bitwise_equal": summary["params_sha256"] == reference["params_sha256"],
            "leftovers": leftovers, "not_visible": chaos.not_visible(output, faults),
            "wall_s": round(wall_s, 1), "first_step_after_s": round(job.first_step_unix - job.launch_unix, 1),
            "reference_step_ms": round(reference_step_s * 1e3, 2), "own_step_ms": round(own_step_s * 1e3, 2),
            "goodput": round(steps * reference_step_s / wall_s, 4),
            "goodput_at_own_step": round(steps * own_step_s / wall_s, 4),
            "goodput_counter": causes,
            "by_kind": {kind: {"count": len(of), "median_seconds_lost": statistics.median(c["seconds_lost"] for c in of),
                               "steps_redone": [c["steps_redone"] for c in of]}
                        for kind in chaos.KINDS if (of := [c for c in costs if c["kind"] == kind])},
            "faults": costs,
        }
    print(chaos.table(costs, visible))
    print(f"\nfinal step {summary.get('step')} of {steps}; bitwise equal to the unbroken run: {result['bitwise_equal']}; "
          f"left behind: {leftovers or 'nothing'}; not seen in the log: {result['not_visible'] or 'none'}")
    print(f"wall {wall_s:.1f} s (first step {result['first_step_after_s']} s after launch); step ms: unbroken "
          f"{result['reference_step_ms']}, own {result['own_step_ms']}; goodput {result['goodput']:.3f}, at own step "
          f"{result['goodput_at_own_step']:.3f}; elastictrain's counter by cause (s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in causes["seconds_by_cause"].items()))
    print(f"load at start: {result['uptime_at_start']}\nload at end:   {result['uptime_at_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
