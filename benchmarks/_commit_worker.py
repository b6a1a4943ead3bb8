"""One process of benchmarks/commit_throughput.py: holds the ~200 MB state and commits, writes or restores it on request.

It reads one JSON request per line on stdin and answers one JSON line on stdout. It imports
``elastictrain`` from whatever tree PYTHONPATH names first, so the benchmark runs the same
requests through this checkout and through an older one (``--baseline``) side by side; it uses
only what both have (``SnapshotStore.commit/prune/latest_valid``, ``snapshot.writer_for`` and
``load_object``) and reads the newer extras (commit timings, the read log) when they exist.

Requests (``op``): ``raw`` writes the pre-serialised bytes of both objects with write+fsync (or
one bare PUT each on S3); ``commit`` commits both objects through ``SnapshotStore.commit`` and
prunes; ``restore`` runs ``latest_valid`` and loads both objects with ``load_object``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from dataclasses import asdict, is_dataclass

import torch

import elastictrain
from benchmarks import _big_task
from elastictrain import rng, snapshot
from elastictrain.storage import SnapshotStore


def build_objects() -> dict:
    """model.pt and state.pt as the snapshotter writes them: weights, then Adam's state after one step and the rest."""
    task = _big_task.build()
    model, optimizer = task.model, task.optimizer
    inputs, labels = task.train_data[:16]
    task.loss_fn(model, (inputs, labels)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = {
        "format_version": 1,
        "optimizer": optimizer.state_dict(),
        "progress": {"global_step": 1, "epoch": 0, "epoch_offset": 16},
        "rng": [rng.capture_rng(torch.device("cpu"))],
    }
    return {"model.pt": model.state_dict(), "state.pt": state}


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) to now; return the RSS now."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return rss_bytes("VmRSS")


class ReadLog(logging.Handler):
    """Keeps the arguments of the store's 'read snapshot ...' line (bytes, read_s, algorithms, verify_s), if it logs one."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.args: tuple | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("read snapshot "):
            self.args = record.args


class Worker:
    def __init__(self) -> None:
        self.objects = build_objects()
        self.serialised: dict[str, bytes] | None = None
        self.read_log = ReadLog()
        storage_log = logging.getLogger("elastictrain.storage")
        storage_log.addHandler(self.read_log)
        storage_log.setLevel(logging.INFO)
        storage_log.propagate = False

    def writers(self, state_writer: str) -> dict:
        model_writer = snapshot.writer_for(self.objects["model.pt"])
        if state_writer == "torch.save":  # what snapshotter.py does for state.pt today
            state = self.objects["state.pt"]
            return {"model.pt": model_writer, "state.pt": lambda fileobj: torch.save(state, fileobj)}
        return {"model.pt": model_writer, "state.pt": snapshot.writer_for(self.objects["state.pt"])}

    def store(self, request: dict) -> SnapshotStore:
        return SnapshotStore(request["url"], request.get("storage_options") or None)

    def raw(self, request: dict) -> dict:
        if self.serialised is None:
            self.serialised = {}
            for name, obj in self.objects.items():
                buffer = io.BytesIO()
                torch.save(obj, buffer)
                self.serialised[name] = buffer.getvalue()
        before = reset_peak_rss()
        write_s = fsync_s = 0.0
        if request["url"].startswith("s3://"):
            store = self.store(request)
            started = time.perf_counter()
            for name, data in self.serialised.items():
                store.fs.pipe_file(f"{store.root}/raw-{request['step']}/{name}", data)
            write_s = time.perf_counter() - started
        else:
            directory = os.path.join(request["url"], f"raw-{request['step']}")
            os.makedirs(directory)
            for name, data in self.serialised.items():
                started = time.perf_counter()
                with open(os.path.join(directory, name), "wb") as raw:
                    raw.write(data)
                    raw.flush()
                    written = time.perf_counter()
                    os.fsync(raw.fileno())
                write_s += written - started
                fsync_s += time.perf_counter() - written
        return {"total_s": write_s + fsync_s, "write_s": write_s, "fsync_s": fsync_s,
                "size_bytes": sum(len(data) for data in self.serialised.values()),
                "peak_rss_delta_bytes": rss_bytes("VmHWM") - before}

    def commit(self, request: dict) -> dict:
        store = self.store(request)
        writers = self.writers(request.get("state_writer", "save_object"))
        before = reset_peak_rss()
        started = time.perf_counter()
        manifest = store.commit(request["step"], writers, {"world_size": 1})
        committed = time.perf_counter()
        store.prune(request.get("keep_last", 1))
        pruned = time.perf_counter()
        timings = getattr(store, "last_commit_timings", None)
        return {"total_s": committed - started, "prune_s": pruned - committed,
                "size_bytes": sum(entry.size for entry in manifest.objects.values()),
                "breakdown": asdict(timings) if is_dataclass(timings) else None,
                "peak_rss_delta_bytes": rss_bytes("VmHWM") - before}

    def restore(self, request: dict) -> dict:
        store = self.store(request)
        self.read_log.args = None
        before = reset_peak_rss()
        started = time.perf_counter()
        manifest, payload = store.latest_valid()
        read = time.perf_counter()
        loaded = {name: snapshot.load_object(data, name) for name, data in payload.items()}
        done = time.perf_counter()
        assert torch.equal(loaded["model.pt"]["2.weight"], self.objects["model.pt"]["2.weight"])
        read_log = self.read_log.args
        return {"total_s": done - started, "read_verify_s": read - started, "load_s": done - read,
                "read_s": read_log[2] if read_log else None, "verify_s": read_log[4] if read_log else None,
                "step": manifest.step, "peak_rss_delta_bytes": rss_bytes("VmHWM") - before}


def main() -> None:
    torch.set_num_threads(1)
    worker = Worker()
    print(json.dumps({"ready": True, "elastictrain": os.path.dirname(elastictrain.__file__), "torch": torch.__version__}),
          flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        print(json.dumps(getattr(worker, request["op"])(request)), flush=True)


if __name__ == "__main__":
    main()
