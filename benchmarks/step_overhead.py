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


def run_once(mode: str, model: str, steps: int, workdir: pathlib.Path) -> float:
    out = workdir / f"{mode}-{model}-{time.time_ns()}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", str(WORKER), f"--mode={'hand' if mode == 'hand' else 'elastictrain'}",
               f"--model={model}", f"--steps={steps}", f"--out={out}", f"--run-dir={workdir / 'run'}"]
    env = {**os.environ, "OVERHEAD_CONFIG": json.dumps(MODES[mode] or {})}
    return run_job(command, env, out, f"{mode} on {model}", workdir)


def run_job(command: list[str], env: dict[str, str], out: pathlib.Path, label: str, workdir: pathlib.Path) -> float:
    """Run one benchmark job whose rank 0 writes ``{"step_s": ...}`` to ``out``, and return that step time."""
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
    return json.loads(out.read_text())["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "step_overhead.json"))
    args = parser.parse_args()
    steps = {"wide": 200, "tiny": 600}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        for model, n in steps.items():
            times = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                order = list(MODES)[repeat % len(MODES):] + list(MODES)[:repeat % len(MODES)]  # rotate the order
                for mode in order:
                    times[mode].append(run_once(mode, model, n, workdir))
            results[model] = {f"{mode}_step_ms": [t * 1e3 for t in times[mode]] for mode in MODES}
            for mode in ("elastictrain", "vote_every_step", "virtual_shards"):
                ratios = [e / h for e, h in zip(times[mode], times["hand"], strict=True)]
                key = "" if mode == "elastictrain" else f"{mode}_"
                results[model][f"{key}median_ratio"] = statistics.median(ratios)
                results[model][f"{key}ratio_of_medians"] = statistics.median(times[mode]) / statistics.median(times["hand"])
            # The bitwise-elastic mode against the default mode, paired within each repetition.
            results[model]["virtual_vs_default_median_ratio"] = statistics.median(
                v / e for v, e in zip(times["virtual_shards"], times["elastictrain"], strict=True))
    print("| model | hand step ms (median) | elastictrain step ms (median) | median of paired ratios | target "
          "| vote at every step: median ratio | bitwise-elastic step ms | bitwise-elastic / default, median of pairs |")
    print("|---|---|---|---|---|---|---|---|")
    for model, r in results.items():
        print(f"| {model} | {statistics.median(r['hand_step_ms']):.3f} | {statistics.median(r['elastictrain_step_ms']):.3f} "
              f"| {r['median_ratio']:.3f} | <= 1.02 {'met' if r['median_ratio'] <= 1.02 else 'NOT met'} "
              f"| {r['vote_every_step_median_ratio']:.3f} | {statistics.median(r['virtual_shards_step_ms']):.3f} "
              f"| {r['virtual_vs_default_median_ratio']:.3f} |")
    pathlib.Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
