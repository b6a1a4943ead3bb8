"""Restore of the ~200 MB snapshot on 2 gloo ranks: how the bytes reach every rank, side by side.

The snapshotter today has rank 0 read and verify the newest snapshot and hand the whole
``(manifest, {name: bytes})`` to every rank with ``broadcast_object_list``, which pickles it,
copies it into a tensor, sends it and unpickles it on the other side. This compares, in one
run, with 2 processes on one machine (gloo over loopback):

- ``broadcast_object_list``: what the snapshotter does (``collectives.broadcast_from_main``);
- ``tensor broadcast``: rank 0 reads and verifies; the manifest goes by ``broadcast_object_list``
  (a few hundred bytes), each object by ``dist.broadcast`` of a uint8 tensor received into a
  buffer of the manifest's size, so nothing is pickled;
- ``every rank reads``: each rank runs ``latest_valid`` itself (possible when every rank can
  read the store: object stores, shared filesystems, one node).

Each measurement ends when every rank has loaded both objects with ``load_object``; methods
rotate order every repetition. The state is committed once, beforehand, with this checkout's
store.

    PYTHONPATH=. .venv/bin/python benchmarks/restore_broadcast.py --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastictrain.snapshot import format as snapshot
from elastictrain.storage.snapshot_store import SnapshotStore

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
METHODS = ("broadcast_object_list", "tensor broadcast", "every rank reads")


def commit_state(url: str) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks._commit_worker import build_objects

    objects = build_objects()
    manifest = SnapshotStore(url).commit(1, {name: snapshot.writer_for(obj) for name, obj in objects.items()}, {})
    return sum(entry.size for entry in manifest.objects.values())


def restore(method: str, store: SnapshotStore, rank: int) -> dict:
    if method == "every rank reads":
        _, payload = store.latest_valid()
    elif method == "broadcast_object_list":
        holder = [store.latest_valid() if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        _, payload = holder[0]
    else:
        found = store.latest_valid() if rank == 0 else None
        holder = [found[0] if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)  # the manifest alone: names and sizes
        manifest = holder[0]
        payload = {}
        for name, entry in sorted(manifest.objects.items()):
            if rank == 0:
                buffer = bytearray(found[1][name])  # frombuffer needs a writable buffer
            else:
                buffer = bytearray(entry.size)
            dist.broadcast(torch.frombuffer(buffer, dtype=torch.uint8), src=0)
            payload[name] = bytes(buffer) if rank else found[1][name]
    return {name: snapshot.load_object(data, name) for name, data in payload.items()}


def worker(rank: int, port: int, url: str, repeats: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    store = SnapshotStore(url)
    rows = []
    for repeat in range(-1, repeats):  # -1: warm-up, not counted
        order = METHODS[repeat % len(METHODS):] + METHODS[:repeat % len(METHODS)]
        for method in order:
            dist.barrier()  # every rank starts together
            started = time.perf_counter()
            loaded = restore(method, store, rank)
            elapsed = time.perf_counter() - started
            assert loaded["model.pt"]["2.weight"].shape == (4096, 4096)
            del loaded
            if repeat >= 0:
                rows.append({"method": method, "repeat": repeat, "rank": rank, "seconds": elapsed})
    results[rank] = rows
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "restore_broadcast.json")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="restore-broadcast-") as scratch:
        url = os.path.join(scratch, "snapshots")
        size_bytes = commit_state(url)
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(worker, args=(free_port(), url, args.repeats, results), nprocs=2, join=True)
            rows = [row for rank_rows in results.values() for row in rank_rows]
    # One measurement is the slower rank's time: the restore is done when every rank has the state.
    per_repeat = {}
    for row in rows:
        key = (row["method"], row["repeat"])
        per_repeat[key] = max(per_repeat.get(key, 0.0), row["seconds"])
    summary = {method: round(statistics.median(seconds for (m, _), seconds in per_repeat.items() if m == method), 3)
               for method in METHODS}
    print(f"restore of {size_bytes / 1e6:.0f} MB on 2 gloo ranks, until every rank has loaded it "
          f"(median of {args.repeats}, slower rank)\n")
    print("| method | seconds |\n|---|---|")
    for method, seconds in summary.items():
        print(f"| {method} | {seconds:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "restore_broadcast", "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "total_wall_s": round(time.monotonic() - started, 1), "python": platform.python_version(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "size_bytes": size_bytes,
        "median_s": summary, "rows": rows,
    }, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
