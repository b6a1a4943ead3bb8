"""SIGKILL of one worker -> first completed step after restore, in parts, for elastictrain and the textbook loop.

What it measures. Each trial starts the 2-worker job under real torchrun,

    torchrun --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:0 --max-restarts=3 ...

with ``LOGLEVEL=INFO`` so the agent logs its own steps. Once the job has committed its first
snapshot (checkpoint) and trained a few steps past it, rank 1's pid is SIGKILLed from outside;
the trial ends at rank 0's first completed step of the restarted attempt. The parts come from
timestamps: the kill (this process's clock), the agent's log lines, and the workers' log lines
(elastictrain: millisecond log lines of rank 0 with ``train.log_every_steps=1``; the textbook
loop, ``benchmarks/_textbook_recovery_worker.py``: one line per event with a unix time).

- detect: kill -> the agent sends SIGTERM to the surviving worker (its monitor saw the death);
- stop: -> "Worker group FAILED" (the survivor has exited);
- rendezvous: -> "Rendezvous complete" for the next attempt (the agent starts the workers then);
- start: -> the new rank 0 has imported its modules: interpreter, torch, and for elastictrain
  its CLI, config and dependencies (elastictrain logs nothing that early, so its jobs use the
  task factories of ``benchmarks/_timed_task.py``, which print a line when called and when done);
- build: model, optimizer and data (the first optimizer imports ``torch._dynamo``);
- init: the process group (elastictrain: ``dist.setup`` with its store and lease token);
- wrap: DDP and, for elastictrain, the rest of SETUP up to RESTORE;
- read: elastictrain's RESTORE on rank 0 up to "read snapshot ..." (store probe, lease, listing,
  read, verify); the textbook's read is inside its load;
- load: elastictrain's broadcast of the bytes to every rank and load; the textbook's
  ``torch.load`` of its checkpoint and ``load_state_dict``;
- first step: -> rank 0's first step line of the new attempt.

The two jobs are the default job (elastictrain's spirals task; snapshot every 100 steps, kill at
step 110) and the ~200 MB state (``benchmarks/_big_task.py``; snapshot every 5 steps, kill at step
7), and, elastictrain only, the ~200 MB state with the fast tier (a copy in ``/dev/shm`` at every
step, so the restart restores the node's copy of step 7 or 6 instead of the durable step 5; the
tier's directory is removed after each trial). Modes alternate within each trial. Import cost is also measured at the end by starting two
interpreters at once (as torchrun starts two workers) that import torch alone, and
``elastictrain.train.trainer`` (what ``python -m elastictrain train`` imports before it builds anything).

``default job + warm start + a rank raises`` has no kill: rank 1's ``loss_fn`` raises at step 110 of the first
attempt (``_timed_task.spirals_raising``), and the clock starts at its line before the raise. ``--burners N`` runs
N CPU-bound processes beside every job (a loaded machine), started a minute before the first trial so that
the load average has caught up; each trial records the load average at its start and end.

    PYTHONPATH=. .venv/bin/python benchmarks/recovery.py --trials 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from elastictrain.launcher.warm_client import process_started_unix
from tests.helpers import procs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXTBOOK = pathlib.Path(__file__).resolve().with_name("_textbook_recovery_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=3"]
JOBS = {
    "default job": {
        "elastictrain": ["task.factory=benchmarks._timed_task:spirals", "train.log_every_steps=1", "log.plots=false"],
        "textbook": ["--task", "spirals", "--every", "100"],
        "snapshot_step": 100, "kill_at_step": 110,
    },
    "~200 MB state": {
        "elastictrain": ["task.factory=benchmarks._timed_task:big", "train.batch_size=16", "train.max_epochs=100",
                         "snapshot.durable.every_steps=5", "train.log_every_steps=1", "log.plots=false"],
        "textbook": ["--task", "big", "--every", "5"],
        "snapshot_step": 5, "kill_at_step": 7,
    },
    # The same with the fast tier (issue 17): a copy in /dev/shm at every step besides the durable one
    # every 5; the restarted group restores the fast copy of step 7 (or 6) instead of the durable 5.
    "~200 MB state + fast tier": {
        "elastictrain": ["task.factory=benchmarks._timed_task:big", "train.batch_size=16", "train.max_epochs=100",
                         "snapshot.durable.every_steps=5", "snapshot.local.every_steps=1", "train.log_every_steps=1",
                         "log.plots=false"],
        "fast_tier": True, "modes": ("elastictrain",),
        "snapshot_step": 5, "kill_at_step": 7,
    },
}
# Warm restarts: the same jobs with torchrun starting -m elastictrain.launcher.warmstart before the worker, so
# the restarted workers are forked from a preloaded interpreter (torch, torch._dynamo, elastictrain).
JOBS["default job + warm start"] = {**JOBS["default job"], "warm": True, "modes": ("elastictrain",)}
JOBS["~200 MB state + fast tier + warm start"] = {**JOBS["~200 MB state + fast tier"], "warm": True}
# The default job with both trackers on (TensorBoard, and MLflow on a real `mlflow server` on 127.0.0.1 this
# benchmark starts): the trackers open on a thread of their own, off the restart's path.
JOBS["default job + trackers"] = {**JOBS["default job"], "trackers": True, "modes": ("elastictrain",)}
# A rank that raises instead of being killed: rank 1's loss_fn raises at step 110 of the first attempt
# (benchmarks/_timed_task.py: spirals_raising); the clock starts at its "raising" line.
JOBS["default job + warm start + a rank raises"] = {
    **JOBS["default job + warm start"],
    "elastictrain": ["task.factory=benchmarks._timed_task:spirals_raising", *JOBS["default job"]["elastictrain"][1:]],
    "env": {"TIMED_TASK_RAISE_AT": "110"}, "raises": True,
}
MLFLOW_URI = ""  # main() starts a server when a job has trackers
MODES = ("elastictrain", "textbook")
PHASES = ("detect", "stop", "rendezvous", "start", "build", "init", "wrap", "read", "load", "first_step")
START_TIMEOUT_S = 300.0
RECOVERY_TIMEOUT_S = 60.0  # the textbook init can hang on the dead attempt's store keys (restart_recovery.py)

AGENT_LINE = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ \S+\] (.*)$")
ELASTIC_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \[elastictrain r(\d+) a(\d+)\] \w+ (.*)$")
TEXTBOOK_LINE = re.compile(r"^(?:textbook|timed-task) rank (\d+) restart (\d+) t=([\d.]+) (.*)$")


# --override: key=value for every elastictrain job (on a GPU: dist.device=cuda:0 dist.backend=gloo, both ranks on it).
OVERRIDES: list[str] = []


def command(mode: str, job: dict, workdir: pathlib.Path) -> list[str]:
    if mode == "elastictrain":
        fast = [f"snapshot.local.url={fast_tier_dir(workdir)}"] if job.get("fast_tier") else []
        warm = ["-m", "elastictrain.launcher.warmstart"] if job.get("warm") else []
        track = ["track.tensorboard=true", f"track.mlflow_uri={MLFLOW_URI}", f"track.mlflow_experiment={workdir.name}"
                 ] if job.get("trackers") else []
        return [*TORCHRUN, *warm, "-m", "elastictrain", "train", f"run.dir={workdir}", *job["elastictrain"], *fast,
                *track, *OVERRIDES]
    return [*TORCHRUN, str(TEXTBOOK), "--checkpoint", str(workdir / "checkpoint.pt"), *job["textbook"]]


def fast_tier_dir(workdir: pathlib.Path) -> str:
    return f"/dev/shm/elastictrain-recovery-{os.getpid()}-{workdir.name}"


def unix_time(hours: str, minutes: str, seconds: str, fraction: str, near_unix: float) -> float:
    """A wall-clock time of day from a log line, on the date of ``near_unix``."""
    day = datetime.datetime.fromtimestamp(near_unix)
    moment = day.replace(hour=int(hours), minute=int(minutes), second=int(seconds), microsecond=int(fraction.ljust(6, "0")))
    return moment.timestamp()


def events(output: str, near_unix: float) -> list[tuple[float, str, int | None, int | None, str]]:
    """(unix time, source, rank, attempt, message) for every agent, elastictrain and textbook line."""
    found = []
    for line in output.splitlines():
        if match := AGENT_LINE.match(line):
            found.append((unix_time(*match.groups()[:4], near_unix), "agent", None, None, match.group(5)))
        elif match := ELASTIC_LINE.match(line):
            hours, minutes, seconds, millis, rank, attempt, message = match.groups()
            found.append((unix_time(hours, minutes, seconds, millis, near_unix), "worker", int(rank), int(attempt), message))
        elif match := TEXTBOOK_LINE.match(line):
            rank, attempt, when, message = match.groups()
            found.append((float(when), "worker", int(rank), int(attempt), message))
    return found


def worker_pid(output: str, rank: int, restart: int) -> int | None:
    """The pid a worker printed in its first line (workers started by multiprocessing have no RANK in /proc/<pid>/environ)."""
    found = re.search(rf"^(?:textbook|timed-task) rank {rank} restart {restart} t=[\d.]+ (?:start|factory-start) pid (\d+)$",
                      output, re.MULTILINE)
    return int(found.group(1)) if found else None


def step_pattern(mode: str, attempt: int) -> re.Pattern:
    if mode == "elastictrain":
        return re.compile(rf"\[elastictrain r0 a{attempt}\] INFO step (\d+) epoch", re.MULTILINE)
    return re.compile(rf"^textbook rank 0 restart {attempt} t=[\d.]+ step (\d+)$", re.MULTILINE)


def trial(job_name: str, mode: str, workdir: pathlib.Path) -> dict:
    job = JOBS[job_name]
    workdir.mkdir(parents=True)
    launched = procs.launch(command(mode, job, workdir), log_path=workdir / "job.log",
                            env={"PYTHONPATH": str(REPO_ROOT), "LOGLEVEL": "INFO", **job.get("env", {})}, cwd=REPO_ROOT)
    before, after = step_pattern(mode, 0), step_pattern(mode, 1)
    saved = (re.compile(rf"snapshot \S+/step-0*{job['snapshot_step']} committed") if mode == "elastictrain"
             else re.compile(rf"^textbook rank 0 restart 0 t=[\d.]+ saved {job['snapshot_step']}$", re.MULTILINE))
    result = {"job": job_name, "mode": mode, "outcome": "recovered", "load_at_start": os.getloadavg()[0]}
    try:
        if job.get("raises"):
            raised = re.compile(r"^timed-task rank 1 restart 0 t=([\d.]+) raising$", re.MULTILINE)
            launched.wait_for(lambda out: raised.search(out) is not None, START_TIMEOUT_S, "rank 1's raise")
            killed_unix = float(raised.search(launched.output()).group(1))
        else:
            launched.wait_for(lambda out: saved.search(out) is not None
                              and any(int(step) >= job["kill_at_step"] for step in before.findall(out)),
                              START_TIMEOUT_S, f"step {job['kill_at_step']} after the first snapshot")
            victim = worker_pid(launched.output(), rank=1, restart=0)
            os.kill(victim, signal.SIGKILL)
            killed_unix = time.time()
        try:
            launched.wait_for(lambda out: after.search(out) is not None, RECOVERY_TIMEOUT_S, "the first step after the restart")
            new_rank0 = worker_pid(launched.output(), rank=0, restart=1)
            result["worker_start_unix"] = process_start_unix(new_rank0) if new_rank0 else None
        except AssertionError as exc:  # the agent gave up, or no step within the time limit
            result["outcome"] = "failed"
            result["error"] = str(exc).splitlines()[0]
    finally:
        result["load_at_end"] = os.getloadavg()[0]
        procs.kill_all_launched()
        shutil.rmtree(fast_tier_dir(workdir), ignore_errors=True)  # the job was killed: no DONE cleaned it
    output = launched.output()
    if result["outcome"] != "recovered":  # evidence: where the restarted attempt stood
        result["last_lines"] = [line[:300] for line in output.splitlines()[-12:]]
    if result["outcome"] == "recovered":
        result.update(phases(mode, events(output, killed_unix), killed_unix, result.get("worker_start_unix")))
    result["restored_step"] = restored_step(mode, output)
    return result


def process_start_unix(pid: int) -> float | None:
    """When ``pid`` started, to the clock tick (10 ms); None if it is gone."""
    try:
        return process_started_unix(pid)
    except OSError:
        return None


def restored_step(mode: str, output: str) -> int | None:
    first = step_pattern(mode, 1).search(output)
    return int(first.group(1)) - 1 if first else None


def phases(mode: str, found: list[tuple], killed_unix: float, worker_start_unix: float | None) -> dict:
    """Named moments after the kill, and the spans between them."""
    def first(source: str, predicate, attempt: int | None = None) -> float | None:
        for when, where, rank, attempt_of_line, message in found:
            if when >= killed_unix - 0.001 and where == source and (attempt is None or attempt_of_line == attempt) \
                    and (rank in (None, 0)) and predicate(message):
                return when
        return None

    moments = {
        "killed": killed_unix,
        "sigterm_sent": first("agent", lambda m: "closing signal SIGTERM" in m),
        "group_failed": first("agent", lambda m: "Worker group FAILED" in m),
        "rendezvous_done": first("agent", lambda m: "Rendezvous complete" in m),
        "workers_started": first("agent", lambda m: "Starting worker group" in m),
        "worker_process_start": worker_start_unix,
    }
    if mode == "elastictrain":
        moments |= {
            "imported": first("worker", lambda m: m.startswith("factory-start"), 1),
            "built": first("worker", lambda m: m == "factory-end", 1),
            "pg_up": first("worker", lambda m: m.startswith("process group"), 1),
            "restore_begins": first("worker", lambda m: m.startswith("state SETUP -> RESTORE"), 1),
            "snapshot_read": first("worker", lambda m: m.startswith("read snapshot"), 1),
            "loaded": first("worker", lambda m: m.startswith("restored snapshot"), 1),
            "first_step": first("worker", lambda m: re.match(r"step \d+ epoch", m) is not None, 1),
        }
        spans = {
            "start": ("rendezvous_done", "imported"), "build": ("imported", "built"), "init": ("built", "pg_up"),
            "wrap": ("pg_up", "restore_begins"), "read": ("restore_begins", "snapshot_read"),
            "load": ("snapshot_read", "loaded"), "first_step": ("loaded", "first_step"),
        }
    else:
        moments |= {
            "imported": first("worker", lambda m: m == "imported", 1),
            "pg_up": first("worker", lambda m: m == "pg-up", 1),
            "built": first("worker", lambda m: m == "built", 1),
            "wrapped": first("worker", lambda m: m == "ddp", 1),
            "loaded": first("worker", lambda m: m == "loaded", 1),
            "first_step": first("worker", lambda m: re.match(r"step \d+$", m) is not None, 1),
        }
        spans = {
            "start": ("rendezvous_done", "imported"), "init": ("imported", "pg_up"), "build": ("pg_up", "built"),
            "wrap": ("built", "wrapped"), "load": ("wrapped", "loaded"), "first_step": ("loaded", "first_step"),
        }
    spans = {"detect": ("killed", "sigterm_sent"), "stop": ("sigterm_sent", "group_failed"),
             "rendezvous": ("group_failed", "rendezvous_done"), **spans}
    seconds = {name: (None if moments.get(a) is None or moments.get(b) is None else round(moments[b] - moments[a], 3))
               for name, (a, b) in spans.items()}
    total = None if moments["first_step"] is None else round(moments["first_step"] - killed_unix, 3)
    return {"moments_unix": moments, "phases_s": seconds, "kill_to_first_step_s": total}


def import_cost(repeats: int) -> dict:
    """Wall time of two interpreters started at once importing torch alone, and elastictrain.train.trainer."""
    code = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    modules = ("torch", "elastictrain.train.trainer")
    walls: dict[str, list[dict]] = {module: [] for module in modules}
    for repeat in range(repeats):
        for module in modules if repeat % 2 == 0 else modules[::-1]:  # interleaved: load drift falls on both
            started = time.perf_counter()
            pair = [subprocess.Popen([sys.executable, "-c", code.format(module=module)], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}) for _ in range(2)]
            imports = [float(proc.communicate()[0]) for proc in pair]
            walls[module].append({"process_wall_s": time.perf_counter() - started, "import_s": max(imports)})
    return {module: {key: round(statistics.median(w[key] for w in walls[module]), 3) for key in ("process_wall_s", "import_s")}
            for module in modules}


def summarise(results: list[dict]) -> dict:
    summary = {}
    for job in dict.fromkeys(r["job"] for r in results):  # the jobs that ran, in order
        for mode in JOBS[job].get("modes", MODES):
            mine = [r for r in results if r["job"] == job and r["mode"] == mode]
            if not mine:  # a mode left out with --modes
                continue
            recovered = [r for r in mine if r["outcome"] == "recovered" and r.get("kill_to_first_step_s") is not None]
            entry = {"trials": len(mine), "recovered": len(recovered)}
            if recovered:
                entry["median_kill_to_first_step_s"] = round(statistics.median(r["kill_to_first_step_s"] for r in recovered), 2)
                entry["max_kill_to_first_step_s"] = max(r["kill_to_first_step_s"] for r in recovered)
                entry["median_phases_s"] = {
                    phase: round(statistics.median(values), 3) if (values := [r["phases_s"][phase] for r in recovered
                                                                             if r["phases_s"].get(phase) is not None]) else None
                    for phase in PHASES
                }
            summary[f"{job} / {mode}"] = entry
    return summary


def table(summary: dict) -> str:
    lines = ["| job / mode | recovered | kill -> first step s (median, max) | "
             + " | ".join(phase.replace("_", " ") for phase in PHASES) + " |",
             "|---|---|---|" + "---|" * len(PHASES)]
    for name, entry in summary.items():
        if not entry["recovered"]:
            lines.append(f"| {name} | 0/{entry['trials']} | - |" + " - |" * len(PHASES))
            continue
        parts = entry["median_phases_s"]
        lines.append(f"| {name} | {entry['recovered']}/{entry['trials']} | {entry['median_kill_to_first_step_s']:.2f}, "
                     f"{entry['max_kill_to_first_step_s']:.2f} | "
                     + " | ".join("-" if parts[phase] is None else f"{parts[phase]:.2f}" for phase in PHASES) + " |")
    return "\n".join(lines)


def run_trials(args: argparse.Namespace, jobs: list[str]) -> list[dict]:
    global MLFLOW_URI
    results = []
    with tempfile.TemporaryDirectory(prefix="recovery-") as scratch:
        server = None
        if any(JOBS[job].get("trackers") for job in jobs):
            from tests.helpers.mlflow_server import MlflowServer

            server = MlflowServer(pathlib.Path(scratch))
            MLFLOW_URI = server.uri
        for index in range(args.trials):
            for job in jobs:
                job_modes = [mode for mode in JOBS[job].get("modes", MODES) if mode in args.modes.split(",")]
                modes = job_modes if index % 2 == 0 else job_modes[::-1]  # alternate which mode goes first
                for mode in modes:
                    result = trial(job, mode, pathlib.Path(scratch) / f"{index}-{len(results)}")
                    result["trial"] = index
                    results.append(result)
                    print(f"trial {index} {job} {mode}: {result['outcome']} kill->first step "
                          f"{result.get('kill_to_first_step_s')} s {result.get('phases_s')}", file=sys.stderr, flush=True)
        if server is not None:
            server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma separated: " + ", ".join(JOBS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated: " + ", ".join(MODES))
    parser.add_argument("--import-repeats", type=int, default=6)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "recovery.json")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="an elastictrain override for every elastictrain job, repeatable (e.g. dist.device=cuda:0)")
    parser.add_argument("--burners", type=int, default=0, help="CPU-bound processes beside every job (a loaded machine)")
    args = parser.parse_args()
    OVERRIDES[:] = args.override
    jobs = [name.strip() for name in args.jobs.split(",") if name.strip()]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        parser.error(f"--jobs: unknown {', '.join(unknown)}")
    started_at, started = time.time(), time.monotonic()
    with procs.cpu_burners(args.burners) as burners:
        if burners:  # the load average (a minute's) catches up with them before the first trial
            time.sleep(60)
        results = run_trials(args, jobs)
    imports = import_cost(args.import_repeats) if args.import_repeats else {}
    summary = summarise(results)
    print(table(summary))
    print(f"imports, two interpreters at once (median of {args.import_repeats}): " + ", ".join(
        f"{module} {cost['import_s']:.2f} s (process {cost['process_wall_s']:.2f} s)" for module, cost in imports.items()))
    report = {
        "benchmark": "recovery", "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "started_unix_s": round(started_at, 1), "total_wall_s": round(time.monotonic() - started, 1),
        "python": platform.python_version(), "cpu_count": os.cpu_count(), "torchrun": TORCHRUN[1:],
        "jobs": {name: JOBS[name] for name in jobs}, "overrides": OVERRIDES, "burners": args.burners,
        "load_range": [min((r["load_at_start"] for r in results), default=None), max((r["load_at_end"] for r in results), default=None)],
        "summary": summary, "imports": imports, "trials": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
