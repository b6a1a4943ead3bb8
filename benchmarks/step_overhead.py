"""Step time of elastictrain against a textbook DDP loop: same model, data, batch and world size.

Each repetition runs both under real ``torchrun --nproc-per-node=2`` (gloo, CPU), in alternating
order, so load on the machine falls on both; the ratio is the median of elastictrain's
steady-state step time over the textbook loop's. elastictrain runs with snapshots off but
everything else on: the per-step vote (preemption and timed snapshots), metric sums, the
goodput observer and the progress report.

    PYTHONPATH=. .venv/bin/python benchmarks/step_overhead.py --repeats 5
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


# elastictrain as shipped, with the vote at every step (preempt.vote_every_s=0: the cadence before
# the vote learned to span several short steps), to show what the cadence buys, and in the
# bitwise-elastic mode (two virtual shards on two ranks: one each, as in the default mode), to
# show what bitwise-elastic costs against the default.
MODES = {"hand": None, "elastictrain": {}, "vote_every_step": {"preempt": {"vote_every_s": 0}},
         "virtual_shards": {"train": {"virtual_shards": 2}}}
# Issue 52's comparison at 4xLinear(64) (model "small"): Trainer and a custom Session loop, snapshots off and
# everything on (async durable every 50 steps, fast tier auto with survivor copies, watchdog, vote, gradient
# checks; thread pinning is on by default). The fast tier's url is filled in per job.
EVERYTHING = {"snapshot": {"durable": {"every_steps": 50, "async_write": True},
                           "local": {"every_s": "auto", "survivor_copies": True}},
              "anomaly": {"check_gradients": True}}
# The same on time-based cadences, as the snapshot-tiers guide configures them (durable every_s=300 there; 10 s here,
# so that a job of --steps 10000, ~25 s, holds two or three durable snapshots and its fast copies in the span timed).
TIMED = {"snapshot": {"durable": {"every_steps": 0, "every_s": 10, "async_write": True},
                      "local": {"every_s": "auto", "survivor_copies": True}},
         "anomaly": {"check_gradients": True}}
# What each part of it costs a custom loop: the same without survivor copies, and without the gradient checks.
TIMED_NO_SURVIVORS = json.loads(json.dumps(TIMED))
TIMED_NO_SURVIVORS["snapshot"]["local"]["survivor_copies"] = False
TIMED_NO_CHECKS = {**TIMED, "anomaly": {"check_gradients": False}}
MODES.update({"session": {}, "trainer_all_on": EVERYTHING, "session_all_on": EVERYTHING,
              "trainer_timed": TIMED, "session_timed": TIMED,
              "timed_no_survivors": TIMED_NO_SURVIVORS, "timed_no_checks": TIMED_NO_CHECKS})
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the fast tier's copies: in node memory, as the guide says
WORKER_MODE = {"hand": "hand", "session": "session", "session_all_on": "session", "session_timed": "session",
               "timed_no_survivors": "session", "timed_no_checks": "session"}  # the rest: Trainer


def run_once(mode: str, model: str, steps: int, workdir: pathlib.Path, fast: pathlib.Path,
             root: pathlib.Path = REPO_ROOT) -> dict:
    """One job of ``mode`` on ``model``: rank 0's ``{"step_s", "snapshots_timed"}`` (snapshots committed in the span
    timed, per tier); ``fast``: where fast copies go; ``root``: the checkout whose elastictrain it runs (``--before``),
    with this checkout's worker, so that both report the same fields."""
    out = workdir / f"{mode}-{model}-{time.time_ns()}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", str(WORKER),
               f"--mode={WORKER_MODE.get(mode, 'elastictrain')}",
               f"--model={model}", f"--steps={steps}", f"--out={out}", f"--run-dir={workdir / f'run-{out.stem}'}",
               f"--warmup={min(30, steps // 3)}", f"--batch-size={64 if model == 'small' else 32}"]
    config = json.loads(json.dumps(MODES[mode] or {}))
    if "local" in config.get("snapshot", {}):
        config["snapshot"]["local"]["url"] = str(fast / f"fast-{out.stem}")
    env = {**os.environ, "OVERHEAD_CONFIG": json.dumps(config), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    return run_job(command, env, out, f"{mode} on {model}", workdir)


def run_job(command: list[str], env: dict[str, str], out: pathlib.Path, label: str, workdir: pathlib.Path) -> dict:
    """Run one benchmark job whose rank 0 writes ``{"step_s": ...}`` to ``out``, and return what it wrote."""
    job = procs.launch(command, log_path=workdir / f"{out.stem}.log", env=env, cwd=REPO_ROOT)
    try:
        # The textbook loop can hang in destroy_process_group at exit (gloo's threads and the GIL;
        # elastictrain's teardown avoids it): its result is written before, so a job that has
        # written it and not exited 30 s later is killed, with its workers, and the result kept.
        deadline = time.monotonic() + 600
        while job.proc.poll() is None and time.monotonic() < deadline and not out.exists():
            time.sleep(0.2)
        code = job.wait(30) if out.exists() else job.wait(1)
    except AssertionError:  # still running: hung at exit, or never wrote a result
        code = None
    finally:
        job.kill_all()
    if not out.exists():
        raise RuntimeError(f"{label}: no result (exit {code}); log in {job.log_path}")
    if code != 0:
        print(f"{label}: result written, then {'hung at exit' if code is None else f'exit {code}'}; "
              "job killed, result kept", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="wide,tiny", help="comma-separated: wide, tiny, small (4xLinear(64), SGD)")
    parser.add_argument("--modes", default="hand,elastictrain,vote_every_step,virtual_shards",
                        help=f"comma-separated, hand first: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=0, help="steps a job (0: 200 wide, 600 otherwise)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "step_overhead.json"))
    parser.add_argument("--before", default="", help="another checkout (e.g. `git worktree add /tmp/before main`): "
                        "each mode but hand also runs on its code, as <mode>@before, in the same rounds")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "hand" or any(m not in MODES for m in modes):
        parser.error(f"--modes must start with hand and name only {', '.join(MODES)}")
    roots = {mode: REPO_ROOT for mode in modes}
    if args.before:
        roots.update({f"{mode}@before": pathlib.Path(args.before).resolve() for mode in modes[1:]})
        modes = [modes[0], *(m for mode in modes[1:] for m in (mode, f"{mode}@before"))]
    results, loads = {}, [load()]
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=SHM) as fast:
        workdir = pathlib.Path(tmp)
        for model in args.models.split(","):
            n = args.steps or (200 if model == "wide" else 600)
            times, snapshots = {mode: [] for mode in modes}, {mode: [] for mode in modes}
            collections = {mode: [] for mode in modes}  # rank 0's full garbage collections in the span timed
            medians, cpus = {mode: [] for mode in modes}, {mode: [] for mode in modes}  # rank 0's median step, CPU s
            for repeat in range(args.repeats):
                # Rotate the order, and reverse it every other round: each mode runs in each place and after
                # different modes (rotated only, a mode always follows the same one, or begins the round).
                order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
                order = order[::-1] if repeat % 2 else order
                for mode in order:
                    job = run_once(mode.removesuffix("@before"), model, n, workdir, pathlib.Path(fast), roots[mode])
                    times[mode].append(job["step_s"])
                    medians[mode].append(job["median_step_s"])
                    cpus[mode].append(job["cpu_step_s"])
                    snapshots[mode].append(job.get("snapshots_timed", {}))
                    collections[mode].append(job.get("full_collections"))
                loads.append(load())
            results[model] = {f"{mode}_step_ms": [t * 1e3 for t in times[mode]] for mode in modes}
            # Beside the mean: the median step (the per-step cost, without the periodic work and the machine's
            # hiccups) and rank 0's CPU seconds a step (every thread), each paired with the hand loop's.
            for name, values in (("median_step", medians), ("cpu_step", cpus)):
                results[model].update({f"{mode}_{name}_ms": [t * 1e3 for t in values[mode]] for mode in modes})
                results[model].update({f"{mode}_{name}_median_ratio": statistics.median(
                    a / b for a, b in zip(values[mode], values["hand"], strict=True)) for mode in modes[1:]})
            results[model].update({f"{mode}_snapshots_timed": snapshots[mode] for mode in modes if any(snapshots[mode])})
            results[model].update({f"{mode}_full_collections": collections[mode] for mode in modes})
            for mode in modes[1:]:
                ratios = [e / h for e, h in zip(times[mode], times["hand"], strict=True)]
                results[model][f"{mode}_ratios"] = ratios
                results[model][f"{mode}_median_ratio"] = statistics.median(ratios)
                if f"{mode}@before" in times:  # this checkout against the other, paired within each round
                    paired = [a / b for a, b in zip(times[mode], times[f"{mode}@before"], strict=True)]
                    results[model][f"{mode}_over_before_ratios"] = paired
                    results[model][f"{mode}_over_before_median"] = statistics.median(paired)
    print(f"load average (1 min) at start and after each round: {', '.join(f'{x:.1f}' for x in loads)}")
    with_before = " | this checkout / --before, median of paired (min-max)" if args.before else ""
    print(f"| model | mode | step ms (median) | ratio to hand, median of paired (min-max){with_before} |")
    print("|---|---|---|---|" + ("---|" if args.before else ""))
    for model, r in results.items():
        for mode in modes:
            ratio = "1" if mode == "hand" else \
                f"{r[mode + '_median_ratio']:.3f} ({min(r[mode + '_ratios']):.2f}-{max(r[mode + '_ratios']):.2f})"
            before = "" if f"{mode}_over_before_median" not in r else \
                f" | {r[mode + '_over_before_median']:.3f} ({min(r[mode + '_over_before_ratios']):.2f}-" \
                f"{max(r[mode + '_over_before_ratios']):.2f})"
            print(f"| {model} | {mode} | {statistics.median(r[mode + '_step_ms']):.3f} | {ratio}{before} |")
            if mode != "hand":
                print(f"  {mode}: median step / hand's {r[mode + '_median_step_median_ratio']:.3f}, "
                      f"CPU a step / hand's {r[mode + '_cpu_step_median_ratio']:.3f} (medians of paired)")
            if any(r.get(mode + "_full_collections", [])):
                print(f"  {mode}: the collector's full passes in each job's span timed (count, seconds): "
                      f"{[tuple(c) if c else None for c in r[mode + '_full_collections']]}")
            if mode + "_snapshots_timed" in r:
                print(f"  {mode}: snapshots committed in each job's span timed: {r[mode + '_snapshots_timed']}")
    pathlib.Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats, "modes": modes,
        "load_average": loads, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
