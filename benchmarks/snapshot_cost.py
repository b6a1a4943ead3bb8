"""What a snapshot of a ~200 MB state costs training: blocking, asynchronous, and DCP async_save.

One process trains the 16.7 M-parameter MLP with Adam of ``_big_task.py`` (a ~200 MB snapshot)
with elastictrain, in turn with snapshots off, blocking (``snapshot.durable.async_write=false``) and in
the background (``snapshot.durable.async_write=true``), every ``--every`` steps to a local directory;
repetitions rotate the order. For each mode it reports the step time (the span between the
forward of the first and the last step, divided by the steps: snapshots included), the time
training was blocked per snapshot (the reports the observers get), and rank 0's resident
memory at the end. In the same process it times ``torch.distributed.checkpoint.async_save`` of
the same model and optimizer state: its blocking part (until it returns) and the whole save.

The amortised slow-down at one snapshot per 30 s (and per 10 s, the fast tier's question) is the
measured extra time per snapshot (step time with snapshots minus without, times the steps between
snapshots) over 30 s (10 s); the last column is the blocked time alone over 10 s, which the
step-time noise of a few percent does not hide. ``fast_tier`` and ``fast_tier_sync`` write to
``/dev/shm`` only (``snapshot.local.url``), in the background and while training waits.

    PYTHONPATH=. .venv/bin/python benchmarks/snapshot_cost.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks import _big_task
from elastictrain import Trainer
from elastictrain.core.events import Observer

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
# fast_tier: snapshots to node memory only (snapshot.local.url under /dev/shm), in the background;
# fast_tier_sync: the same written while training waits (snapshot.local.async_write=false).
SHM = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else pathlib.Path(tempfile.gettempdir())
MODES = ("off", "blocking", "async", "fast_tier", "fast_tier_sync")
FAST_MODES = ("fast_tier", "fast_tier_sync")


class Reports(Observer):
    def __init__(self) -> None:
        self.reports = []
        self.rss_mb = []  # resident memory after each reported snapshot

    def snapshotted(self, report) -> None:
        self.reports.append(report)
        self.rss_mb.append(rss_mb())


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def leak_check(snapshots: int, workdir: pathlib.Path) -> dict:
    """Resident memory after the 10th and after the last of ``snapshots`` background snapshots, one per step."""
    task = _big_task.build(samples=(snapshots + 1) * 32)
    reports = Reports()
    run_dir = workdir / "run-leak"
    Trainer.from_task(task, {
        "run": {"dir": str(run_dir)},
        "train": {"max_epochs": 1, "max_steps": snapshots, "batch_size": 32, "log_every_steps": 1000},
        "snapshot": {"durable": {"every_steps": 1, "on_done": False, "keep_last": 2, "async_write": True,
                                 "lease_stale_after_s": 0}},
        "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
    }, observers=[reports]).fit()
    shutil.rmtree(run_dir)
    return {"snapshots": len(reports.rss_mb), "rss_mb_after_10": reports.rss_mb[9], "rss_mb_after_last": reports.rss_mb[-1],
            "rss_mb": reports.rss_mb}


def train(mode: str, steps: int, every: int, workdir: pathlib.Path) -> dict:
    task = _big_task.build(samples=steps * 32)
    stamps: list[float] = []
    loss_fn = task.loss_fn

    def timed_loss(module, batch):
        stamps.append(time.perf_counter())
        return loss_fn(module, batch)

    task.loss_fn = timed_loss
    run_dir = workdir / f"run-{mode}-{time.time_ns()}"
    reports = Reports()
    trainer = Trainer.from_task(task, {
        "run": {"dir": str(run_dir)},
        "train": {"max_epochs": 1, "batch_size": 32, "log_every_steps": 1000},
        "snapshot": {
            "durable": {"every_steps": every if mode in ("blocking", "async") else 0, "on_done": False, "keep_last": 2,
                        "async_write": mode in ("async", *FAST_MODES), "lease_stale_after_s": 0},
            "local": {"url": str(SHM / f"snapshot-cost-{os.getpid()}") if mode in FAST_MODES else None,
                      "async_write": mode != "fast_tier_sync", "every_steps": every}},
        "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
    }, observers=[reports])
    trainer.fit()
    tiers = trainer.session._restoring.tiers  # a look inside: the staging buffers are no public fact of the run
    staged_mb = (tiers.local or tiers.durable)._stager.nbytes / 1e6  # 0 where nothing was staged
    shutil.rmtree(run_dir)
    shutil.rmtree(SHM / f"snapshot-cost-{os.getpid()}", ignore_errors=True)
    committed = [r for r in reports.reports if r.committed]
    return {
        "step_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
        "snapshots": len(committed),
        "blocked_s": [r.duration_s for r in committed],
        "write_s": [r.write_s for r in committed],
        "staging_buffers_mb": staged_mb,
    }


def dcp_async_save(workdir: pathlib.Path, trials: int) -> dict:
    """DCP's async_save of the same state (one rank, a gloo group of one, as DCP needs a group)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    task = _big_task.build(samples=64)
    # One step so the optimizer has its moments (the ~200 MB).
    task.optimizer.zero_grad()
    task.loss_fn(task.model, next(iter(torch.utils.data.DataLoader(task.train_data, batch_size=32)))).backward()
    task.optimizer.step()
    blocking, total = [], []
    try:
        for trial in range(trials):
            state = {"model": task.model.state_dict(), "optimizer": task.optimizer.state_dict()}
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(workdir / f"dcp-{trial}"))
            blocking.append(time.perf_counter() - started)
            future.result()
            total.append(time.perf_counter() - started)
            shutil.rmtree(workdir / f"dcp-{trial}")
    finally:
        dist.destroy_process_group()
    return {"blocking_s": blocking, "total_s": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--leak-snapshots", type=int, default=100, help="background snapshots of the memory check")
    parser.add_argument("--dir", default=None, help="where snapshots are written (default: a temporary directory)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "snapshot_cost.json"))
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        workdir = pathlib.Path(tmp)
        runs = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]:
                runs[mode].append(train(mode, args.steps, args.every, workdir))
        leak = leak_check(args.leak_snapshots, workdir)
        dcp = dcp_async_save(workdir, trials=max(3, args.repeats))
    off_step = statistics.median(r["step_s"] for r in runs["off"])
    summary = {}
    for mode in MODES:
        step_s = statistics.median(r["step_s"] for r in runs[mode])
        blocked = [b for r in runs[mode] for b in r["blocked_s"]]
        row = {"step_ms": step_s * 1e3, "step_ratio_to_off": step_s / off_step}
        if mode != "off":
            extra_per_snapshot_s = (step_s - off_step) * args.every
            row.update({
                "blocked_per_snapshot_ms_median": statistics.median(blocked) * 1e3,
                "blocked_per_snapshot_ms_max": max(blocked) * 1e3,
                "extra_per_snapshot_s": extra_per_snapshot_s,
                "slowdown_at_one_per_30s": max(0.0, extra_per_snapshot_s) / 30.0,
                "slowdown_at_one_per_10s": max(0.0, extra_per_snapshot_s) / 10.0,
                "blocked_at_one_per_10s": statistics.median(blocked) / 10.0,
            })
            writes = [w for r in runs[mode] for w in r["write_s"] if w > 0]
            if writes:
                row["background_write_s_median"] = statistics.median(writes)
        summary[mode] = row
    dcp_blocking = statistics.median(dcp["blocking_s"])
    summary["dcp_async_save"] = {"blocking_ms_median": dcp_blocking * 1e3,
                                 "total_s_median": statistics.median(dcp["total_s"])}
    async_blocked = summary["async"]["blocked_per_snapshot_ms_median"] / 1e3
    summary["async_blocked_over_dcp_blocking"] = async_blocked / dcp_blocking
    print(f"resident memory after 10 background snapshots: {leak['rss_mb_after_10']:.0f} MB, after "
          f"{leak['snapshots']}: {leak['rss_mb_after_last']:.0f} MB")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"~200 MB state, a snapshot every {args.every} steps of {args.steps}, {args.repeats} repeats, one process")
    print("| mode | step ms (median) | vs off | blocked per snapshot ms (median, max) | extra per snapshot s "
          "| slow-down at 1 per 30 s | at 1 per 10 s | blocked alone at 1 per 10 s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        row = summary[mode]
        if mode == "off":
            print(f"| off | {row['step_ms']:.1f} | 1.000 | | | | | |")
            continue
        print(f"| {mode} | {row['step_ms']:.1f} | {row['step_ratio_to_off']:.3f} | "
              f"{row['blocked_per_snapshot_ms_median']:.0f}, {row['blocked_per_snapshot_ms_max']:.0f} | "
              f"{row['extra_per_snapshot_s']:.3f} | {100 * row['slowdown_at_one_per_30s']:.2f} % | "
              f"{100 * row['slowdown_at_one_per_10s']:.2f} % | {100 * row['blocked_at_one_per_10s']:.2f} % |")
    print(f"| DCP async_save | | | {dcp_blocking * 1e3:.0f} (its whole save {summary['dcp_async_save']['total_s_median']:.2f} s) | | | | |")
    print(f"async blocked / DCP async_save blocking: {summary['async_blocked_over_dcp_blocking']:.2f} (target <= 0.5); "
          f"staging buffers {runs['async'][0]['staging_buffers_mb']:.0f} MB; peak RSS of this process {peak_rss_mb:.0f} MB")
    pathlib.Path(args.out).write_text(json.dumps({
        "benchmark": "snapshot_cost", "command": f"python benchmarks/snapshot_cost.py --repeats {args.repeats}",
        "torch": torch.__version__, "python": platform.python_version(), "started_unix_s": started,
        "wall_s": time.time() - started, "settings": vars(args), "summary": summary, "runs": runs, "dcp": dcp, "leak_check": leak,
        "peak_rss_mb": peak_rss_mb,
    }, indent=2))


if __name__ == "__main__":
    main()
