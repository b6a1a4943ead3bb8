"""FSDP2: elastictrain's ``dist.strategy=fsdp`` against a hand-written FSDP2 loop of the same model.

Two measurements, each under real ``torchrun --nproc-per-node=2`` (gloo, CPU), the two sides in
alternating order per repetition so that load on the machine falls on both:

- step time: elastictrain with snapshots off against the hand loop (median of paired ratios; target <= 1.02);
- training time blocked per snapshot: elastictrain's sharded snapshot (every rank writes its DCP shards,
  hashes a share of the files, rank 0 commits the manifest; synchronous) against DCP ``async_save`` of the
  same model and optimizer in the hand loop (the call, plus waiting for the previous save), and elastictrain's with
  ``snapshot.durable.async_write`` (the wait for the previous write plus staging the shards).

    PYTHONPATH=. .venv/bin/python benchmarks/fsdp.py --repeats 3
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

WORKER = pathlib.Path(__file__).resolve().with_name("_fsdp_worker.py")


def run_once(mode: str, steps: int, every: int, workdir: pathlib.Path) -> dict:
    out = workdir / f"{mode}-{time.time_ns()}.json"
    run_dir = workdir / f"run-{out.stem}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", str(WORKER), f"--mode={mode}", f"--steps={steps}", f"--every={every}",
               f"--out={out}", f"--run-dir={run_dir}"]
    job = procs.launch(command, log_path=workdir / f"{out.stem}.log", env=dict(os.environ), cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 600
        while job.proc.poll() is None and time.monotonic() < deadline and not out.exists():
            time.sleep(0.2)
        code = job.wait(30) if out.exists() else job.wait(1)
    except AssertionError:  # hung at exit (the hand loop's destroy_process_group) or no result
        code = None
    finally:
        job.kill_all()
    if not out.exists():
        raise RuntimeError(f"{mode}: no result (exit {code}); log in {job.log_path}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "fsdp.json"))
    args = parser.parse_args()
    pairs = {"step": ("hand", "elastictrain"), "snapshot": ("hand_async", "elastictrain_snap", "elastictrain_async")}
    runs: dict[str, list[dict]] = {mode: [] for pair in pairs.values() for mode in pair}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for pair in pairs.values():
                for mode in (pair if repeat % 2 == 0 else pair[::-1]):
                    runs[mode].append(run_once(mode, args.steps, args.every, pathlib.Path(tmp)))
    step = {mode: [r["step_s"] * 1e3 for r in runs[mode]] for mode in runs}
    ratios = [e / h for e, h in zip(step["elastictrain"], step["hand"], strict=True)]
    blocked = {mode: [b * 1e3 for r in runs[mode] for b in r["blocked_s"]] for mode in pairs["snapshot"]}
    results = {
        "hand_step_ms": step["hand"], "elastictrain_step_ms": step["elastictrain"],
        "median_ratio": statistics.median(ratios),
        "async_save_blocked_ms_median": statistics.median(blocked["hand_async"]),
        "elastictrain_blocked_ms_median": statistics.median(blocked["elastictrain_snap"]),
        "elastictrain_async_blocked_ms_median": statistics.median(blocked["elastictrain_async"]),
        "snapshots": {mode: len(values) for mode, values in blocked.items()},
        "step_with_snapshots_ms": {mode: step[mode] for mode in pairs["snapshot"]},
    }
    print("| hand FSDP2 step ms (median) | elastictrain fsdp step ms (median) | median of paired ratios | target |")
    print("|---|---|---|---|")
    print(f"| {statistics.median(step['hand']):.2f} | {statistics.median(step['elastictrain']):.2f} "
          f"| {results['median_ratio']:.3f} | <= 1.02 {'met' if results['median_ratio'] <= 1.02 else 'NOT met'} |")
    print(f"\ntraining blocked per snapshot (median ms): DCP async_save {results['async_save_blocked_ms_median']:.1f}, "
          f"elastictrain sharded (synchronous) {results['elastictrain_blocked_ms_median']:.1f}, "
          f"elastictrain sharded (async_write) {results['elastictrain_async_blocked_ms_median']:.1f}")
    pathlib.Path(args.out).write_text(json.dumps({
        "torch": torch.__version__, "python": platform.python_version(), "repeats": args.repeats, "steps": args.steps,
        "every": args.every, "load_1m": os.getloadavg()[0], "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
