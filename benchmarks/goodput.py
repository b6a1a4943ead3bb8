"""Goodput under a SIGKILL every minute: the textbook epoch checkpoint against elastictrain, with and without the fast tier.

What it measures. Each job is a real 2-worker ``torchrun --rdzv-backend=c10d
--max-restarts=1000 --monitor-interval=0.1`` run of the same model, data and batch
(``benchmarks/_goodput_worker.py``: 4 x (Linear(1024, 1024) + ReLU) + Linear(1024, 10), AdamW,
32 samples per rank) for a fixed number of optimizer steps, ``--epochs`` epochs of about
``--epoch-s`` seconds each (7 x 30 s by default). While a faulted job runs, this script
SIGKILLs one worker every ``--kill-every`` seconds from launch (the rank drawn from a seeded
generator: the same ranks, in the same order, for every job of a repeat) until the agent exits.

Each repeat runs the textbook loop unbroken and saving nothing (``reference``), as many steps as a
faulted job (``--reference-steps`` sets another length), before every faulted job and once more
after the last, and the faulted jobs in an order rotated from one repeat to the next:

- ``textbook``: the PyTorch DDP tutorial's recipe: at every epoch's end rank 0 ``torch.save``s
  model, optimizer and epoch to one file; a restarted attempt loads it and starts the next epoch;
- ``elastictrain``: its defaults, a durable snapshot every ``--every-steps`` (100) steps,
  written while training waits;
- ``elastictrain-fast``: two tiers, as docs/guides/snapshot-tiers.md sets them up: node-local
  copies under ``--fast-dir`` (/dev/shm) every ``--fast-every-s`` (``auto``: Young/Daly's interval
  from the measured cost and failure rate; ``--fast-every-steps`` adds a step interval), and the
  durable tier every ``--fast-durable-every-s`` (120 s) instead of every 100 steps; durable
  snapshots written in the background with ``--fast-async`` (default), while training waits
  without; fast copies while training waits (``--no-fast-local-async``, the default: on two busy
  cores a background write only competes with the step) or in the background;
- ``elastictrain-warm``: ``elastictrain-fast`` launched as ``torchrun ... -m elastictrain.launcher.warmstart
  WORKER``: every restarted worker is forked from a preloaded interpreter (elastictrain/launcher/warmstart.py).
- ``elastictrain-warm-timed``: ``elastictrain-warm`` with ``snapshot.local.survivor_copies=false``: only
  timed fast copies, no survivor copy of the step a worker died in (elastictrain/snapshot/survivor.py), so
  the two side by side show what survivor copies are worth.

A faulted job's reference step time is the mean step time of the two reference runs around it
over their training span (first step's forward to the last's, over the steps between): on a
shared machine the load drifts within minutes, and the neighbours see the load the job saw more
closely than one reference for the whole repeat would. They are as long as the job because a
sustained load runs slower here than a short one, and the mean (not the median) keeps the slow
steps an unbroken run has too, so only what the faulted job does that an unbroken run does not
(start-up, restarts, snapshots, re-done steps, the loop's own per-step cost, the finish) counts
against it. ``--epoch-s`` over the median step of a short unbroken ``calibration`` run sets the
epoch length in steps (``--epoch-steps`` fixes it and skips that run).

Goodput = (steps the final model contains x reference step time) / wall time of the job from
launch to the agent's exit. Each reference is scored by the same formula against its own mean
step, about 1 - (start-up + finish) / wall: the ceiling for a job of that length under that load. Two more
columns: ``vs median``, the same ratio at the references' median step interval (the definition of
earlier runs, which charged the tail every run has to the faults), and ``at own step``, at the
job's own median step time: it leaves out the loop's per-step cost (``step_overhead.py``
measures that) and the load's drift, and keeps what faults cost.
The tables also give, per job: kills, restarts, steps trained twice, where the rest of the wall
time went and what each restart was made of (``_goodput_timeline.py``), and for elastictrain its
own goodput counter (rank 0's ``Trainer.session.goodput`` at the end, the counter the Prometheus
exporter serves). The load is recorded at the start and end of every job: on a shared 2-core
machine it moves every number.

    PYTHONPATH=. .venv/bin/python benchmarks/goodput.py

Every process a job starts is SIGKILLed by pid when it ends (``tests/helpers/procs.py``), and
the script stops if anything running the worker survives.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks import _goodput_timeline as timeline_of
from benchmarks._goodput_timeline import Kill
from tests.helpers import procs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(__file__).resolve().with_name("_goodput_worker.py")
WORLD_SIZE = 2
MAX_RESTARTS = 1000
POLL_S = 0.02
CALIBRATION_STEPS = 400


@dataclass(frozen=True)
class Job:
    name: str
    loop: str  # textbook | elastictrain
    faulted: bool
    epochs: int
    epoch_steps: int
    config: dict = field(default_factory=dict)  # elastictrain: merged into its config
    fast_tier_url: str | None = None  # elastictrain-fast: where its node-local copies go
    warm: bool = False  # elastictrain-warm: torchrun starts -m elastictrain.launcher.warmstart before the worker
    checkpoint: bool = True  # textbook: save at each epoch's end; the unbroken references save nothing

    @property
    def steps(self) -> int:
        return self.epochs * self.epoch_steps


FAULTED_JOBS = ("textbook", "elastictrain", "elastictrain-fast", "elastictrain-warm", "elastictrain-warm-timed")


def reference_job(args: argparse.Namespace, epoch_steps: int) -> Job:
    """The unbroken reference: the textbook loop saving nothing, as long as the faulted jobs unless --reference-steps."""
    if args.reference_steps:
        return Job("reference", "textbook", faulted=False, epochs=1, epoch_steps=args.reference_steps, checkpoint=False)
    return Job("reference", "textbook", faulted=False, epochs=args.epochs, epoch_steps=epoch_steps, checkpoint=False)


def calibration_job() -> Job:
    """A short unbroken run whose step time sets the epoch length from --epoch-s (not a reference)."""
    return Job("calibration", "textbook", faulted=False, epochs=1, epoch_steps=CALIBRATION_STEPS, checkpoint=False)


def faulted_jobs(args: argparse.Namespace, repeat: int, epoch_steps: int) -> list[Job]:
    """The faulted jobs of one repeat, the order rotated by the repeat's number."""
    fast_url = f"{args.fast_dir.rstrip('/')}/elastictrain-goodput-{os.getpid()}-{repeat}"
    length = {"epochs": args.epochs, "epoch_steps": epoch_steps}
    jobs = [
        Job("textbook", "textbook", faulted=True, **length),
        Job("elastictrain", "elastictrain", faulted=True, **length, config={"snapshot": {"durable": {"every_steps": args.every_steps}}}),
        fast_tier_job("elastictrain-fast", fast_url, args, length),
        fast_tier_job("elastictrain-warm", f"{fast_url}-warm", args, length, warm=True),
        fast_tier_job("elastictrain-warm-timed", f"{fast_url}-warm-timed", args, length, warm=True, survivor=False),
    ]
    chosen = [job for job in jobs if job.name in args.jobs]
    shift = repeat % len(chosen) if chosen else 0
    return chosen[shift:] + chosen[:shift]


def fast_tier_job(name: str, fast_url: str, args: argparse.Namespace, length: dict, warm: bool = False,
                  survivor: bool = True) -> Job:
    """Durable snapshots every --fast-durable-every-s, node-local copies every --fast-every-s (and --fast-every-steps),
    and a survivor copy when a worker dies inside a step (snapshot.local.survivor_copies) unless ``survivor`` is false."""
    every_s = args.fast_every_s if args.fast_every_s == "auto" else float(args.fast_every_s)
    return Job(name, "elastictrain", faulted=True, **length, fast_tier_url=f"{fast_url}/goodput", warm=warm,
               config={"snapshot": {
                   "durable": {"every_steps": 0, "every_s": args.fast_durable_every_s, "async_write": args.fast_async},
                   "local": {"url": fast_url, "every_steps": args.fast_every_steps, "every_s": every_s,
                             "async_write": args.fast_local_async, "survivor_copies": survivor}}})


def torchrun_command(job: Job, workdir: pathlib.Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={WORLD_SIZE}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={MAX_RESTARTS}", "--monitor-interval=0.1",
        *(["-m", "elastictrain.launcher.warmstart"] if job.warm else []),
        str(WORKER), f"--loop={job.loop}", f"--workdir={workdir}", f"--epochs={job.epochs}",
        f"--epoch-steps={job.epoch_steps}", f"--config={json.dumps(job.config)}",
        *([] if job.checkpoint else ["--no-checkpoint"]),
    ]


def current_workers(agent_pid: int) -> dict[int, tuple[int, int]]:
    """rank -> (pid, restart count) of the agent's live workers of its newest attempt, from /proc."""
    found: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or procs.parent_pid(int(name)) != agent_pid or not procs.pid_alive(int(name)):
            continue
        variables = dict(item.decode(errors="replace").split("=", 1) for item in procs.environ(int(name)) if b"=" in item)
        if "RANK" in variables and "TORCHELASTIC_RESTART_COUNT" in variables:
            rank, restart = int(variables["RANK"]), int(variables["TORCHELASTIC_RESTART_COUNT"])
            if rank not in found or restart > found[rank][1]:
                found[rank] = (int(name), restart)
    newest = max((restart for _, restart in found.values()), default=0)
    return {rank: entry for rank, entry in found.items() if entry[1] == newest}


def load_average() -> list[float]:
    return [float(value) for value in pathlib.Path("/proc/loadavg").read_text().split()[:3]]


def _sigkill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it exited between the look-up and the kill: the next poll finds another
        return False
    return True


def run_job(job: Job, repeat: int, scratch: pathlib.Path, args: argparse.Namespace, label: str) -> dict:
    """Launch the job, SIGKILL a worker every --kill-every seconds until the agent exits; return what happened."""
    procs.ensure_none_running(WORKER, f"before {label}")
    print(f"repeat {repeat}: {label}, {job.steps} steps ...", file=sys.stderr, flush=True)
    workdir = scratch / f"{repeat}-{label}"
    workdir.mkdir()
    log_path = workdir / "torchrun.log"
    ranks = random.Random(args.seed + repeat)  # the same victims, in the same order, for every job of a repeat
    kills: list[Kill] = []
    load_at_start = load_average()
    launch_unix, started = time.time(), time.monotonic()
    launched = procs.launch(torchrun_command(job, workdir), log_path=log_path,
                            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    next_kill_s, victim_rank = args.kill_every, ranks.randrange(WORLD_SIZE)
    exit_code, outcome, last_refresh, exit_unix = None, "completed", 0.0, None
    try:
        while (exit_code := launched.proc.poll()) is None:
            now = time.monotonic()
            if now - started > args.job_timeout_s:
                outcome = "timeout"
                break
            if job.faulted and now - started >= next_kill_s:
                # Between attempts no worker of that rank exists: the kill waits for the next one.
                victim = current_workers(launched.proc.pid).get(victim_rank)
                if victim is not None and _sigkill(victim[0]):
                    kills.append(Kill(unix=time.time(), since_launch_s=round(now - started, 3), rank=victim_rank,
                                      restart=victim[1], pid=victim[0]))
                    print(f"  {job.name}: SIGKILL rank {victim_rank} (pid {victim[0]}, restart {victim[1]}) "
                          f"at {now - started:.1f} s", file=sys.stderr, flush=True)
                    next_kill_s += args.kill_every
                    victim_rank = ranks.randrange(WORLD_SIZE)
            if now - last_refresh > 1.0:  # remember every pid ever under the agent, for the reaping below
                launched.refresh()
                last_refresh = now
            time.sleep(POLL_S)
        exit_unix = time.time()  # the agent's exit, within POLL_S
    finally:
        procs.kill_all_launched()  # workers run in sessions of their own: SIGKILL every pid ever seen
        if job.fast_tier_url:
            shutil.rmtree(job.fast_tier_url.rsplit("/", 1)[0], ignore_errors=True)
    if launched.leftover_pids():
        raise RuntimeError(f"{job.name}: pids {launched.leftover_pids()} survived SIGKILL")
    if job.warm:  # the preloaded interpreter and the workers forked from it are no descendants of the agent
        procs.ensure_no_warm_servers(launched.proc.pid, f"after {label}")
    if outcome == "completed" and exit_code != 0:
        outcome = "failed"
    print(f"  {label}: {outcome} in {exit_unix - launch_unix:.1f} s with {len(kills)} kills", file=sys.stderr, flush=True)
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log_path, args.keep_logs / f"goodput-{repeat}-{label}.log")
    return {"job": label, "repeat": repeat, "outcome": outcome, "agent_exit_code": exit_code,
            "launch_unix": launch_unix, "exit_unix": exit_unix, "kills": kills, "log_path": log_path,
            "load_at_start": load_at_start, "load_at_end": load_average(),
            "timeline": timeline_of.parse(log_path.read_text(errors="replace"), launch_unix, job.fast_tier_url)}


def analyse(job: Job, raw: dict, references: list[dict]) -> dict:
    """One job's figures against ``references`` (the unbroken runs beside it; a reference: itself)."""
    reference_step_s, reference_median_s = _reference_step_s(references)
    timeline = raw["timeline"]
    last_attempt = timeline.attempts[max(timeline.attempts)] if timeline.attempts else None
    final_step = (last_attempt.done_step or 0) if raw["outcome"] == "completed" and last_attempt else 0
    result = {
        "job": raw["job"], "repeat": raw["repeat"], "outcome": raw["outcome"], "agent_exit_code": raw["agent_exit_code"],
        "final_step": final_step, "expected_steps": job.steps,
        "wall_s": round(raw["exit_unix"] - raw["launch_unix"], 3),
        "kills": len(raw["kills"]),
        "restarts": max(timeline.attempts, default=0),
        "load_at_start": raw["load_at_start"], "load_at_end": raw["load_at_end"],
        "config": job.config,
        "reference_step_ms": None if reference_step_s is None else round(reference_step_s * 1e3, 3),
        "reference_median_step_ms": None if reference_median_s is None else round(reference_median_s * 1e3, 3),
        "goodput": None,
        "goodput_vs_median": None,
        "goodput_at_own_step": None,
    }
    if final_step != job.steps or reference_step_s is None:
        return result
    result.update(timeline_of.account(timeline, raw["kills"], raw["launch_unix"], raw["exit_unix"], final_step,
                                      reference_step_s))
    # An unbroken reference scored by the same formula shows the ceiling: 1 - (start-up + finish) / wall.
    result["goodput"] = round(final_step * reference_step_s / result["wall_s"], 4)
    if job.faulted:
        result["goodput_vs_median"] = round(final_step * reference_median_s / result["wall_s"], 4)
        result["goodput_at_own_step"] = round(final_step * result["counted_step_median_ms"] / 1e3 / result["wall_s"], 4)
    result["kill_log"] = [asdict(kill) for kill in raw["kills"]]
    if job.loop == "elastictrain":
        counter = timeline.goodput_counter
        if counter is not None:  # the counter leaves the first start-up and killed attempts' unsaved seconds out
            counter["seconds_counted"] = round(sum(counter["seconds_by_cause"].values()), 3)
        result["elastictrain_goodput_counter"] = counter
        result["commits"] = _commit_summary(timeline.commits)
        result["restores_by_tier"] = timeline.restores
        result["summary_line"] = timeline.summary_line
    return result


def _commit_summary(commits: list[dict]) -> dict:
    by_tier: dict[str, dict] = {}
    for tier in sorted({commit["tier"] for commit in commits}):
        of_tier = [commit for commit in commits if commit["tier"] == tier]
        by_tier[tier] = {"count": len(of_tier), "mb": round(of_tier[-1]["bytes"] / 1e6, 1),
                         "median_s": round(statistics.median(commit["seconds"] for commit in of_tier), 3)}
    return by_tier


def format_tables(results: list[dict]) -> str:
    several_repeats = len({r["repeat"] for r in results}) > 1

    def label(result: dict) -> str:
        return f"{result['job']} #{result['repeat']}" if several_repeats else result["job"]

    def cell(value: object, digits: int = 1) -> str:
        if value is None:
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["| job | outcome | steps | wall s | goodput | vs median | at own step | kills | restarts | steps re-done "
             "| median restart s | step ms: reference mean / median / own median | elastictrain's counter "
             "| load 1-min start/end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        restarts = [entry["total_s"] for entry in r.get("restart_log", [])]
        counter = (r.get("elastictrain_goodput_counter") or {}).get("ratio")
        lines.append(
            f"| {label(r)} | {r['outcome']} | {r['final_step']} | {cell(r['wall_s'])} | {cell(r['goodput'], 3)} "
            f"| {cell(r['goodput_vs_median'], 3)} | {cell(r['goodput_at_own_step'], 3)} | {r['kills']} | {r['restarts']} "
            f"| {cell(r.get('redone_steps'))} | {cell(statistics.median(restarts) if restarts else None, 2)} "
            f"| {cell(r['reference_step_ms'], 2)} / {cell(r['reference_median_step_ms'], 2)} / {cell(r.get('counted_step_median_ms'), 2)} "
            f"| {cell(counter, 3)} | {r['load_at_start'][0]:.1f} / {r['load_at_end'][0]:.1f} |")
    lines += ["", "Where the wall time went, seconds (steps x reference mean step + these = wall; a reference "
              "against its own mean):", "",
              "| job | steps x ref | start-up | restarts | re-done steps | snapshots blocking | after snapshots "
              "| slower steps | finish | other |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "parts" not in r:
            continue
        p = r["parts"]
        ideal = r["final_step"] * r["reference_step_ms"] / 1e3
        lines.append(f"| {label(r)} | {ideal:.1f} | {p['startup_s']:.1f} | {p['restart_s']:.1f} | {p['redone_s']:.1f} "
                     f"| {p['snapshot_s']:.1f} | {p['after_snapshot_s']:.1f} | {p['slower_steps_s']:.1f} | {p['finish_s']:.1f} | {p['unattributed_s']:.1f} |")
    lines += ["", "Each restart, medians in seconds, from the kill to the first step of the next attempt that trains:", "",
              "| job | restarts | kill -> agent's failed line | -> new workers exec | -> imported (slowest rank) | -> process group up "
              "| -> set-up done | -> restored | -> first step | total | attempts that never trained | restored from |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("to_agent_noticed_s", "to_exec_s", "exec_to_imported_s", "imported_to_pg_s", "pg_to_setup_done_s",
            "setup_done_to_restored_s", "restored_to_first_step_s", "total_s")
    for r in results:
        if not r.get("restart_log"):
            continue
        medians = [_median_of(r["restart_log"], key) for key in keys]
        tiers = r.get("restores_by_tier")
        restored_from = "checkpoint file" if tiers is None else ", ".join(f"{tier} {count}" for tier, count in tiers.items() if count)
        lines.append(f"| {label(r)} | {len(r['restart_log'])} | " + " | ".join(cell(m, 2) for m in medians)
                     + f" | {sum(entry['attempts_without_steps'] for entry in r['restart_log'])} | {restored_from} |")
    if several_repeats:
        lines += ["", "Over the repeats:", ""]
        for name in dict.fromkeys(r["job"] for r in results if r["goodput_at_own_step"] is not None):
            of_job = [r for r in results if r["job"] == name and r["goodput"] is not None]
            lines.append(f"- {name}: goodput median {statistics.median(r['goodput'] for r in of_job):.3f} "
                         f"({', '.join(format(r['goodput'], '.3f') for r in of_job)}); at own step "
                         f"{statistics.median(r['goodput_at_own_step'] for r in of_job):.3f} "
                         f"({', '.join(format(r['goodput_at_own_step'], '.3f') for r in of_job)})")
    return "\n".join(lines)


def _median_of(entries: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in entries if entry.get(key) is not None]
    return statistics.median(values) if values else None


def _reference_step_s(references: list[dict]) -> tuple[float | None, float | None]:
    """(mean step over the training span, median step interval) of the reference runs that completed (None if none did)."""
    timelines = [raw["timeline"] for raw in references if raw["outcome"] == "completed"]
    if not timelines:
        return None, None
    return timeline_of.mean_step_s(*timelines), timeline_of.median_step_s(*timelines)


def calibrate(repeat: int, scratch: pathlib.Path, args: argparse.Namespace) -> int:
    """Steps per epoch: --epoch-s at the median step of a short unbroken run."""
    raw = run_job(calibration_job(), repeat, scratch, args, "calibration")
    if raw["outcome"] != "completed":
        raise RuntimeError(f"the calibration run failed ({raw['outcome']}); its log: {raw['log_path']}")
    return max(1, round(args.epoch_s / timeline_of.median_step_s(raw["timeline"])))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=7, help="epochs of every faulted job")
    parser.add_argument("--epoch-s", type=float, default=30.0, help="an epoch's length in seconds at the reference step time")
    parser.add_argument("--epoch-steps", type=int, help="optimizer steps per epoch (default: from --epoch-s)")
    parser.add_argument("--reference-steps", type=int, default=0,
                        help="steps of each unbroken reference run (0: as many as a faulted job)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between SIGKILLs, from launch")
    parser.add_argument("--every-steps", type=int, default=100, help="elastictrain's snapshot.durable.every_steps")
    parser.add_argument("--fast-every-steps", type=int, default=0, help="snapshot.local.every_steps of the fast tier")
    parser.add_argument("--fast-every-s", default="auto", help="snapshot.local.every_s of the fast tier (seconds or auto)")
    parser.add_argument("--fast-durable-every-s", type=float, default=120.0,
                        help="snapshot.durable.every_s in the fast-tier jobs (their every_steps is 0)")
    parser.add_argument("--fast-async", action=argparse.BooleanOptionalAction, default=True,
                        help="snapshot.durable.async_write in the fast-tier jobs")
    parser.add_argument("--fast-local-async", action=argparse.BooleanOptionalAction, default=False,
                        help="snapshot.local.async_write in the fast-tier jobs")
    parser.add_argument("--fast-dir", default="/dev/shm", help="where the fast tier lives (node-local)")
    parser.add_argument("--jobs", default=",".join(FAULTED_JOBS), help="faulted jobs, comma separated")
    parser.add_argument("--repeats", type=int, default=1, help="each repeat runs every job, the faulted ones rotated")
    parser.add_argument("--seed", type=int, default=0, help="seeds the ranks killed")
    parser.add_argument("--job-timeout-s", type=float, default=3600.0)
    parser.add_argument("--keep-logs", type=pathlib.Path, help="copy every job's torchrun log into this directory")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "goodput.json")
    args = parser.parse_args()
    args.jobs = [name.strip() for name in args.jobs.split(",") if name.strip()]
    unknown = sorted(set(args.jobs) - set(FAULTED_JOBS))
    if unknown:
        parser.error(f"--jobs: unknown {', '.join(unknown)}; choose from {', '.join(FAULTED_JOBS)}")

    uptime_at_start, started_unix, started = uptime(), time.time(), time.monotonic()
    print(f"load at start: {uptime_at_start}", file=sys.stderr, flush=True)
    results, epoch_steps_by_repeat = [], {}
    with tempfile.TemporaryDirectory(prefix="goodput-") as scratch:
        for repeat in range(args.repeats):
            epoch_steps = args.epoch_steps or calibrate(repeat, pathlib.Path(scratch), args)
            epoch_steps_by_repeat[repeat] = epoch_steps
            reference = reference_job(args, epoch_steps)
            references = [run_job(reference, repeat, pathlib.Path(scratch), args, "reference-0")]
            if references[0]["outcome"] != "completed":
                raise RuntimeError(f"the reference run failed ({references[0]['outcome']}); its log: {references[0]['log_path']}")
            jobs = faulted_jobs(args, repeat, epoch_steps)
            faulted = []
            for index, job in enumerate(jobs, start=1):
                faulted.append(run_job(job, repeat, pathlib.Path(scratch), args, job.name))
                references.append(run_job(reference, repeat, pathlib.Path(scratch), args, f"reference-{index}"))
            results.append(analyse(reference, references[0], references[:1]))
            for index, (job, raw) in enumerate(zip(jobs, faulted)):  # in the order they ran
                results.append(analyse(job, raw, references[index:index + 2]))
                results.append(analyse(reference, references[index + 1], references[index + 1:index + 2]))
    procs.ensure_none_running(WORKER, "after the last job")
    uptime_at_end = uptime()
    total_wall_s = round(time.monotonic() - started, 1)

    print(format_tables(results))
    print(f"epoch steps by repeat: {epoch_steps_by_repeat}; total wall time {total_wall_s} s")
    print(f"load at start: {uptime_at_start}\nload at end:   {uptime_at_end}")
    hashes: dict[int, set[str]] = {}
    for r in results:
        if r.get("summary_line"):
            hashes.setdefault(r["repeat"], set()).add(r["summary_line"].rsplit("params_sha256=", 1)[-1])
    report = {
        "benchmark": "goodput",
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "started_unix_s": round(started_unix, 1),
        "total_wall_s": total_wall_s,
        "uptime_at_start": uptime_at_start,
        "uptime_at_end": uptime_at_end,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "settings": {
            "epochs": args.epochs, "epoch_s": args.epoch_s, "epoch_steps_by_repeat": epoch_steps_by_repeat,
            "reference_steps": args.reference_steps, "kill_every_s": args.kill_every, "every_steps": args.every_steps,
            "fast_every_steps": args.fast_every_steps, "fast_every_s": args.fast_every_s,
            "fast_durable_every_s": args.fast_durable_every_s, "fast_async": args.fast_async,
            "fast_local_async": args.fast_local_async,
            "fast_dir": args.fast_dir, "repeats": args.repeats,
            "seed": args.seed, "world_size": WORLD_SIZE, "batch_size_per_rank": 32,
            "model": "4 x (Linear(1024, 1024) + ReLU) + Linear(1024, 10), AdamW",
            "torchrun": torchrun_command(Job("<job>", "<loop>", False, 0, 0), pathlib.Path("<workdir>"))[1:],
        },
        # Resuming is exact: the elastictrain jobs of a repeat end with the same parameters, whatever was killed when.
        "elastictrain_final_params_identical_by_repeat": {repeat: len(found) == 1 for repeat, found in hashes.items()},
        "jobs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
