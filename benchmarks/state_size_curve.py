"""What snapshots, restores and a restart cost as the state grows: one curve, 2 gloo workers, ~50 MB to a few GB.

For each size (``--sizes``, MB of snapshot: weights and Adam's two moments, ``benchmarks/_size_worker.py``)
one real 2-worker job runs under torchrun with warm restarts,

    torchrun --nproc-per-node=2 --rdzv-backend=c10d --max-restarts=1 -m elastictrain.launcher.warmstart _size_worker.py ...

with a durable snapshot every 4 steps (in the background, to a directory on the same filesystem as
``--dir``), a fast copy every 2 steps (``/dev/shm``, written while training waits: the tier's
default), and survivor copies on. Rank 1 is SIGKILLed at the forward of step ``--kill-at``; the
restarted group restores the survivor copy of the step before. It reports, per size:

- blocked: training blocked per durable snapshot (the copy into reused buffers) and per fast copy;
- commit: the durable snapshot's background write (serialise, write, fsync, manifest) against a raw
  write + fsync of as many bytes to the same filesystem, done by this process after the job;
- survivor: the survivor copy's write (rank 0's log line);
- restore: the restarted rank 0's RESTORE (read, verify, broadcast, load), and a durable restore
  (``SnapshotStore.latest_valid`` + ``load_object``) in this process after the job;
- kill -> first step: the kill to rank 0's first forward of the restarted attempt;
- peak RSS per rank (``VmHWM``) in the first attempt, beside the state size.

``--pretouch-gb G`` first writes one byte to every page of G GB of fresh anonymous memory before
each job, times it and gives it back. On a VM that hands its guest memory over lazily, or takes back
what the guest frees (a balloon's free page reporting, as on this Firecracker VM), memory touched
for the first time is filled at the host's pace (here ~0.44 GB/s: 17 GB in 39 s), and a job whose
files and tensors land on such memory measures the VM. Touched first, the job's costs are the code's.

First, in this process alone (``in_process_rates``), the pieces of a snapshot at each size against a
plain copy of the same bytes moments apart: staging, a save into /dev/shm, a read and load. Raw
bandwidths, measured in this process: a memory copy (``torch.Tensor.copy_`` of 512 MB) and the
raw write + fsync. A linear fit per cost (seconds per GB) says whether it grows with the bytes and
how its rate compares to the bandwidths.

    PYTHONPATH=. .venv/bin/python benchmarks/state_size_curve.py --sizes 50,200,500,1000,2000
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

import torch

from tests.helpers import procs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(__file__).resolve().with_name("_size_worker.py")
SHM = pathlib.Path("/dev/shm")
START_TIMEOUT_S = 600.0
RECOVERY_TIMEOUT_S = 300.0
DURABLE_EVERY, LOCAL_EVERY = 4, 2
BLOCK_BYTES = 50e6
PAGE = mmap.PAGESIZE


def pretouch(gb: float) -> dict:
    """Write one byte to every page of ``gb`` GB of fresh anonymous memory, then give it back: seconds and GB/s."""
    size = int(gb * 1e9) // PAGE * PAGE
    started = time.perf_counter()
    region = mmap.mmap(-1, size)
    try:
        view = memoryview(region)
        for offset in range(0, size, PAGE):
            view[offset] = 1
        view.release()
    finally:
        region.close()
    seconds = time.perf_counter() - started
    return {"gb": gb, "seconds": round(seconds, 2), "gbps": round(gb / seconds, 2)}


def load_average() -> float:
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def read_records(workdir: pathlib.Path) -> dict[str, list[dict]]:
    found = {}
    for path in sorted((workdir / "records").glob("*.jsonl")):
        found[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return found


def raw_write(directory: pathlib.Path, nbytes: int, chunk_mb: int = 64) -> float:
    """Seconds to write ``nbytes`` (one 64 MB buffer repeated) to one new file and fsync it."""
    chunk = os.urandom(chunk_mb << 20)
    path = directory / "raw.bin"
    started = time.perf_counter()
    with open(path, "wb") as raw:
        left = nbytes
        while left > 0:
            raw.write(chunk[:left] if left < len(chunk) else chunk)
            left -= len(chunk)
        raw.flush()
        os.fsync(raw.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def memory_copy_gbps(mb: int = 512, repeats: int = 3) -> float:
    source = torch.rand(mb << 18)  # float32: mb MB
    target = torch.empty_like(source)
    target.copy_(source)  # pages touched
    best = min(_timed(lambda: target.copy_(source)) for _ in range(repeats))
    return mb / 1e3 / best


def _timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def in_process_rates(sizes_mb: list[float], repeats: int = 3) -> list[dict]:
    """Per size, in this process on one thread: the pieces of a snapshot against a plain copy of the same bytes.

    The state is 50 MB tensors (as the worker's blocks). Each repeat times, in turn: ``Tensor.copy_`` of
    every tensor into a reused buffer (the memory bound), ``Stager.stage`` into reused buffers (what a
    background snapshot blocks on), ``save_object`` into a file in /dev/shm (a fast copy's write), and
    reading that file back with ``load_object``. Ratios to the copy at the same size, taken moments apart,
    show whether a piece grows faster than the bytes even where the machine's load moves every number.
    """
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers, pinned to one intra-op thread
    try:
        for mb in sizes_mb:
            rows.append(_rates_at(mb, repeats))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    return rows


def _rates_at(mb: float, repeats: int) -> dict:
    from elastictrain.snapshot import format as snapshot
    from elastictrain.snapshot.staging import Stager
    from elastictrain.storage.mapped import map_file

    tree = {f"t{i}": torch.rand(int(BLOCK_BYTES // 4)) for i in range(max(1, round(mb * 1e6 / BLOCK_BYTES)))}
    nbytes = sum(t.numel() * 4 for t in tree.values())
    buffers = {key: torch.empty_like(t) for key, t in tree.items()}
    stager, path = Stager(), SHM / f"state-size-curve-{os.getpid()}.pt"
    stager.stage(tree)  # buffers allocated: later stages reuse them

    def save() -> None:
        with open(path, "wb") as file:
            snapshot.save_object(tree, file)

    times: dict[str, list[float]] = {"copy": [], "stage": [], "save_shm": [], "load": [], "load_mapped": []}
    try:
        for _ in range(repeats):
            times["copy"].append(_timed(lambda: [buffers[k].copy_(t) for k, t in tree.items()]))
            times["stage"].append(_timed(lambda: stager.stage(tree)))
            times["save_shm"].append(_timed(save))
            times["load"].append(_timed(lambda: snapshot.load_object(path.read_bytes(), "curve")))
            # as a local store reads it now: mapped, each tensor copied out once (storage/mapped.py)
            times["load_mapped"].append(_timed(lambda: snapshot.load_object(map_file(str(path)), "curve")))
    finally:
        path.unlink(missing_ok=True)
    medians = {key: statistics.median(values) for key, values in times.items()}
    return {"mb": nbytes / 1e6, "load_average": load_average(), "seconds": medians,
            "over_copy": {key: round(value / medians["copy"], 2) for key, value in medians.items()}}


def durable_restore(url: str) -> dict:
    from elastictrain.snapshot import format as snapshot
    from elastictrain.storage.snapshot_store import SnapshotStore

    started = time.perf_counter()
    manifest, payload = SnapshotStore(url).latest_valid()
    read = time.perf_counter()
    for name, data in payload.items():
        snapshot.load_object(data, name)
    done = time.perf_counter()
    return {"step": manifest.step, "read_verify_s": read - started, "load_s": done - read, "total_s": done - started,
            "bytes": sum(len(data) for data in payload.values())}


def run_size(mb: float, args: argparse.Namespace, scratch: pathlib.Path) -> dict:
    workdir = scratch / f"size-{int(mb)}"
    workdir.mkdir()
    fast_dir = SHM / f"state-size-curve-{os.getpid()}-{int(mb)}"
    config = {"snapshot": {
        "durable": {"url": str(workdir / "snapshots"), "every_steps": DURABLE_EVERY, "async_write": True, "keep_last": 1,
                    "on_done": False, "lease_stale_after_s": 0},
        "local": {"url": str(fast_dir), "every_steps": LOCAL_EVERY, "keep_last": 1}}}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=1", "--monitor-interval=0.1", "-m", "elastictrain.launcher.warmstart",
               str(WORKER), f"--mb={mb}", f"--workdir={workdir}", f"--steps={args.steps}", f"--config={json.dumps(config)}"]
    touched = pretouch(args.pretouch_gb) if args.pretouch_gb else None
    load_before = load_average()
    launched = procs.launch(command, log_path=workdir / "torchrun.log", env={"PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    result: dict = {"mb": mb, "load_at_start": load_before, "pretouch": touched}
    try:
        reached = re.compile(rf"^size-bench a0 step {args.kill_at} ", re.MULTILINE)
        launched.wait_for(lambda out: reached.search(out) is not None, START_TIMEOUT_S, f"step {args.kill_at}")
        victim = int(re.search(r"^size-bench a0 r1 pid (\d+)$", launched.output(), re.MULTILINE).group(1))
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        first = re.compile(r"^size-bench a1 step \d+ ([\d.]+)$", re.MULTILINE)
        launched.wait_for(lambda out: first.search(out) is not None, RECOVERY_TIMEOUT_S, "the first step after the restart")
        result["kill_to_first_step_s"] = float(first.search(launched.output()).group(1)) - killed
        result["exit_code"] = launched.wait(RECOVERY_TIMEOUT_S)
    finally:
        procs.kill_all_launched()
        shutil.rmtree(fast_dir, ignore_errors=True)
    result["load_at_end"] = load_average()
    output = launched.output()
    records = read_records(workdir)
    attempt0 = records.get("rank0-a0", [])
    durable = [r for r in attempt0 if r["kind"] == "snapshot" and r["tier"] == "durable" and r["committed"]]
    local = [r for r in attempt0 if r["kind"] == "snapshot" and r["tier"] == "local" and r["committed"]]
    restored = [r for r in records.get("rank0-a1", []) if r["kind"] == "restored"]
    survivor = re.search(r"survivor copy of step \d+ written to \S+ in ([\d.]+) s", output)
    state_bytes = durable[0]["bytes"] if durable else (local[0]["bytes"] if local else 0)
    result |= {
        "state_mb": state_bytes / 1e6,
        "durable_snapshots": len(durable), "fast_copies": len(local),
        "durable_blocked_s": statistics.median(r["blocked_s"] for r in durable) if durable else None,
        "durable_write_s": statistics.median(r["write_s"] for r in durable) if durable else None,
        "fast_blocked_s": statistics.median(r["blocked_s"] for r in local) if local else None,
        # each copy's (step, seconds blocked): a fast copy at a durable snapshot's step shares it with that write's start
        "fast_blocked_each": [[r["step"], round(r["blocked_s"], 4)] for r in local],
        "durable_blocked_each": [[r["step"], round(r["blocked_s"], 4)] for r in durable],
        "survivor_copy_s": float(survivor.group(1)) if survivor else None,
        "restart_restore_s": restored[0]["seconds"] if restored else None,
        "restored_step": restored[0]["step"] if restored else None,
        # resident memory at step 2's forward: the model, gradients, DDP's buckets and Adam's moments, no snapshot yet
        "training_rss_mb": {name: next((r["vmrss_mb"] for r in recs if r["kind"] == "memory" and r.get("step") == 2), None)
                            for name, recs in records.items()},
        "peak_rss_mb": {name: max((r.get("vmhwm_mb", 0) for r in recs if r["kind"] == "memory"), default=None)
                        for name, recs in records.items()},
    }
    if state_bytes:
        result["raw_write_s"] = raw_write(workdir, state_bytes)
        result["durable_restore"] = durable_restore(str(workdir / "snapshots"))
    if result.get("kill_to_first_step_s") is None or not durable:
        result["last_lines"] = output.splitlines()[-15:]
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def slope(points: list[tuple[float, float]]) -> dict | None:
    """Least-squares seconds = a + b * GB, and the largest size's rate against the smallest's."""
    points = [(x, y) for x, y in points if y is not None]
    if len(points) < 2:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return {"s_per_gb": round(b, 3), "intercept_s": round(mean_y - b * mean_x, 3),
            "gb_per_s": round(1 / b, 2) if b > 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200,500,1000,2000", help="MB of snapshot, comma separated")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=10, help="rank 1 is SIGKILLed at the forward of this step")
    parser.add_argument("--dir", default=None, help="where the durable snapshots go (default: the temporary directory)")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "state_size_curve.json")
    parser.add_argument("--pretouch-gb", type=float, default=0.0,
                        help="touch this much fresh memory before each job (a VM's lazily backed memory; see above)")
    parser.add_argument("--in-process-only", action="store_true", help="only the in-process rates, no torchrun jobs")
    args = parser.parse_args()
    started = time.time()
    sizes = [float(size) for size in args.sizes.split(",")]
    rates = in_process_rates(sizes)
    print("in this process, one thread, median of 3: seconds, and over a plain copy of the same bytes")
    print("| state MB | load | copy s | stage s (×copy) | save to /dev/shm s (×copy) | read + load s (×copy) "
          "| mapped load s (×copy) |")
    print("|---|---|---|---|---|---|---|")
    for rate in rates:
        sec, over = rate["seconds"], rate["over_copy"]
        print(f"| {rate['mb']:.0f} | {rate['load_average']:.1f} | {sec['copy']:.3f} | {sec['stage']:.3f} ({over['stage']}) | "
              f"{sec['save_shm']:.3f} ({over['save_shm']}) | {sec['load']:.3f} ({over['load']}) | "
              f"{sec['load_mapped']:.3f} ({over['load_mapped']}) |")
    if args.in_process_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "state_size_curve", "command": " ".join(["python", *sys.argv]),
                                        "in_process": rates}, indent=2) + "\n")
        return
    bandwidth = {"memory_copy_gbps": round(memory_copy_gbps(), 2)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="size-curve-", dir=args.dir) as scratch:
        gb = 2
        bandwidth["raw_write_fsync_gbps"] = round(gb / raw_write(pathlib.Path(scratch), gb << 30) * (1 << 30) / 1e9, 2)
        for mb in sizes:
            row = run_size(mb, args, pathlib.Path(scratch))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "last_lines"}), file=sys.stderr, flush=True)
    gbs = [r["state_mb"] / 1e3 for r in rows]
    costs = ("durable_blocked_s", "durable_write_s", "raw_write_s", "fast_blocked_s", "survivor_copy_s", "restart_restore_s",
             "kill_to_first_step_s")
    fits = {cost: slope([(gb, r.get(cost)) for gb, r in zip(gbs, rows)]) for cost in costs}
    fits["durable_restore_s"] = slope([(gb, r.get("durable_restore", {}).get("total_s")) for gb, r in zip(gbs, rows)])
    fits["peak_rss_rank0_mb"] = slope([(gb, r["peak_rss_mb"].get("rank0-a0")) for gb, r in zip(gbs, rows)])
    fits["peak_rss_rank1_mb"] = slope([(gb, r["peak_rss_mb"].get("rank1-a0")) for gb, r in zip(gbs, rows)])

    def cell(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    print(f"raw bandwidths: memory copy {bandwidth['memory_copy_gbps']} GB/s, write + fsync {bandwidth['raw_write_fsync_gbps']} GB/s")
    print("| state MB | load start→end | blocked durable s | blocked fast s | durable write s | raw write s | "
          "survivor copy s | restart restore s | durable restore s | kill → first step s | peak RSS rank 0 / 1 MB "
          "| RSS before any snapshot rank 0 / 1 MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("pretouch"):
            print(f"  before the {r['state_mb']:.0f} MB job: {r['pretouch']['gb']} GB touched in {r['pretouch']['seconds']} s")
    for r in rows:
        rss = r["peak_rss_mb"]
        print(f"| {r['state_mb']:.0f} | {r['load_at_start']:.1f}→{r['load_at_end']:.1f} | {cell(r.get('durable_blocked_s'), 3)} | "
              f"{cell(r.get('fast_blocked_s'), 3)} | {cell(r.get('durable_write_s'))} | {cell(r.get('raw_write_s'))} | "
              f"{cell(r.get('survivor_copy_s'))} | {cell(r.get('restart_restore_s'))} | "
              f"{cell(r.get('durable_restore', {}).get('total_s'))} | {cell(r.get('kill_to_first_step_s'))} | "
              f"{cell(rss.get('rank0-a0'), 0)} / {cell(rss.get('rank1-a0'), 0)} | "
              f"{cell(r['training_rss_mb'].get('rank0-a0'), 0)} / {cell(r['training_rss_mb'].get('rank1-a0'), 0)} |")
    print("fits, seconds (or MB) = intercept + slope x GB of state:")
    for cost, fit in fits.items():
        print(f"  {cost}: {fit}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "state_size_curve", "command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
        "python": platform.python_version(), "cpu_count": os.cpu_count(), "started_unix_s": started,
        "wall_s": time.time() - started, "bandwidth": bandwidth, "fits": fits, "rows": rows, "in_process": rates,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
