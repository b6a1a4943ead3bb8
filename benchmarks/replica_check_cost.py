"""What the replica check costs at each snapshot, beside the snapshot of the same ~200 MB state, on 2 gloo ranks.

Before every snapshot (both tiers) and at the run's end every rank fingerprints its registered
models and optimizers and the ranks gather the digests (``elastictrain/health/replicas.py``). Two ranks
(``torch.multiprocessing``, gloo over loopback, one intra-op thread each) hold the ~200 MB state of
``benchmarks/_big_task.py`` (16.7 M parameters and Adam's two moments) after one DDP step, and time,
every repetition in a rotated order:

- ``fingerprint``: ``replicas.fingerprint`` of the model and the optimizer on each rank;
- ``check``: ``ReplicaCheck.check``, the fingerprint and the ``all_gather`` of the digests;
- ``snapshot, blocking``: ``DurableTier.save`` of the same state into a store under ``--dir``
  (the durable tier written while training waits);
- ``snapshot, /dev/shm``: the same into /dev/shm (the fast tier's medium);
- ``snapshot, background``: ``snapshot.durable.async_write=true``: what training waits for (the
  state staged into reused buffers); the write itself is waited for outside the timing.

Before the ranks start, one process times the fingerprint of the same state alone against the
fingerprint the issue also offered (per tensor, in float64: a sum, a sum of squares and an
index-weighted sum), the least of 3 each (``one process``).

A time is the slower rank's (a snapshot is done when every rank goes on); CPU time is the busier
rank's, all threads of its process, which moves less than wall time when other work shares the
cores. The snapshot times leave the check out (it is switched off for them), so the columns add up.

    PYTHONPATH=. .venv/bin/python benchmarks/replica_check_cost.py --repeats 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = ("fingerprint", "check", "snapshot, blocking", "snapshot, /dev/shm", "snapshot, background")


def worker(rank: int, port: int, scratch: str, repeats: int, results: dict) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks._big_task import build
    from elastictrain.core.config_load import load_config
    from elastictrain.dist.ddp import wrap_model
    from elastictrain.dist.group import DistContext
    from elastictrain.launcher.launch_env import LaunchEnv
    from elastictrain.health.replicas import ReplicaCheck, fingerprint
    from elastictrain.snapshot.durable_tier import DurableTier

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 300.0)
    task = build()
    model, optimizer = task.model, task.optimizer
    wrapped = wrap_model(model, ctx, load_config(None).dist)
    inputs, labels = task.train_data[:32]
    task.loss_fn(wrapped, (inputs, labels)).backward()  # one DDP step: Adam's moments exist, equal on both ranks
    optimizer.step()
    objects = {"model": model, "optimizer": optimizer}
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    check = ReplicaCheck(ctx, objects, enabled=True)

    def snapshotter(name: str, root: str, background: bool) -> DurableTier:
        cfg = load_config(None, [f"run.dir={scratch}/run", f"snapshot.durable.url={root}/{name}",
                                 f"snapshot.durable.async_write={str(background).lower()}", "snapshot.durable.keep_last=1",
                                 "dist.check_replicas=false"])
        return DurableTier(cfg, ctx, model, {"optimizer": optimizer})

    shm = tempfile.mkdtemp(prefix="replica-check-", dir="/dev/shm") if rank == 0 else None
    shm = [shm]
    dist.broadcast_object_list(shm, src=0)
    tiers = {"snapshot, blocking": snapshotter("blocking", scratch, False),
             "snapshot, /dev/shm": snapshotter("shm", shm[0], False),
             "snapshot, background": snapshotter("background", scratch, True)}
    meta = {"epoch": 0, "epoch_offset": 0, "world_size": 2}
    rows, step = [], 0
    for repeat in range(-1, repeats):  # -1: warm-up, not counted
        order = MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]
        for mode in order:
            step += 1
            dist.barrier()  # every rank starts together
            started, cpu_started = time.perf_counter(), time.process_time()
            if mode == "fingerprint":
                fingerprint(objects)
            elif mode == "check":
                check.check(step, "the benchmark's snapshot")
            else:
                tiers[mode].save(step, meta)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            if mode == "snapshot, background":
                tiers[mode].flush()  # the write in the background, outside the timing
            if repeat >= 0:
                rows.append({"mode": mode, "repeat": repeat, "rank": rank, "seconds": elapsed, "cpu_s": cpu})
    results[rank] = {"rows": rows, "state_bytes": state_bytes}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shm[0], ignore_errors=True)
    dist.destroy_process_group()


def one_process(repeats: int = 3) -> dict[str, float]:
    """The least of ``repeats`` ms: xxh3 (what replicas.py does) against float64 sums, one process, one thread."""
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks._big_task import build
    from elastictrain.health.replicas import fingerprint

    torch.set_num_threads(1)
    task = build()
    inputs, labels = task.train_data[:32]
    task.loss_fn(task.model, (inputs, labels)).backward()
    task.optimizer.step()
    objects = {"model": task.model, "optimizer": task.optimizer}
    tensors = [*task.model.parameters(), *(v for s in task.optimizer.state.values() for v in s.values() if v.numel() > 1)]

    def float_sums() -> list[tuple[float, float, float]]:
        sums = []
        for tensor in tensors:
            values = tensor.detach().reshape(-1).double()
            index = torch.arange(values.numel(), dtype=torch.float64)
            sums.append((values.sum().item(), (values * values).sum().item(), (values * index).sum().item()))
        return sums

    timed = {}
    for name, run in (("fingerprint (xxh3)", lambda: fingerprint(objects)), ("float64 sums", float_sums)):
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
        timed[name] = round(best * 1e3, 1)
    return timed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the blocking and background snapshots go (default: a temp dir)")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "replica_check_cost.json")
    args = parser.parse_args()
    started, load_at_start = time.monotonic(), load_average()
    alone = one_process()
    with tempfile.TemporaryDirectory(prefix="replica-check-", dir=args.dir) as scratch:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(worker, args=(free_port(), scratch, args.repeats, results), nprocs=2, join=True)
            results = dict(results)
    rows = [row for result in results.values() for row in result["rows"]]
    per_repeat: dict[tuple[str, int], float] = {}
    cpu_per_repeat: dict[tuple[str, int], float] = {}
    for row in rows:  # the slower rank's time; the busier rank's CPU time (every thread of its process)
        key = (row["mode"], row["repeat"])
        per_repeat[key] = max(per_repeat.get(key, 0.0), row["seconds"])
        cpu_per_repeat[key] = max(cpu_per_repeat.get(key, 0.0), row["cpu_s"])
    times = {mode: [s for (m, _), s in per_repeat.items() if m == mode] for mode in MODES}
    median_ms = {mode: round(1e3 * statistics.median(seconds), 1) for mode, seconds in times.items()}
    min_ms = {mode: round(1e3 * min(seconds), 1) for mode, seconds in times.items()}  # the least contended repeat
    # CPU time moves less than wall time when other work shares the cores.
    cpu_ms = {mode: round(1e3 * statistics.median(s for (m, _), s in cpu_per_repeat.items() if m == mode), 1)
              for mode in MODES}
    state_mb = results[0]["state_bytes"] / 1e6
    print(f"replica check against snapshots of the same {state_mb:.0f} MB state, 2 gloo ranks "
          f"(median of {args.repeats}, slower rank; load {load_at_start} -> {load_average()})\n")
    print("| what | wall ms (median) | wall ms (min) | CPU ms (median) | check / this, wall | check / this, CPU |\n"
          "|---|---|---|---|---|---|")
    for mode, ms in median_ms.items():
        ratios = ("", "") if not mode.startswith("snapshot") else \
            (f"{median_ms['check'] / ms:.3f}", f"{cpu_ms['check'] / cpu_ms[mode]:.3f}")
        print(f"| {mode} | {ms:.1f} | {min_ms[mode]:.1f} | {cpu_ms[mode]:.1f} | {ratios[0]} | {ratios[1]} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "replica_check_cost", "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "total_wall_s": round(time.monotonic() - started, 1), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "state_bytes": results[0]["state_bytes"],
        "load_at_start": load_at_start, "load_at_end": load_average(), "median_ms": median_ms, "min_ms": min_ms, "cpu_ms": cpu_ms, "one_process_ms": alone,
        "rows": rows,
    }, indent=2) + "\n")
    print("\none process, one thread, the least of 3: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in alone.items()))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
