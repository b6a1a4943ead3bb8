"""Signal -> every worker exited, for the default job and for a ~200 MB state, under real torchrun.

Each trial starts a 2-worker ``torchrun --rdzv-backend=c10d`` job, waits until it is training
(its first periodic log line), sends SIGTERM to the torchrun agent (what a scheduler or
``kill`` does; the agent forwards it to the workers), and times until the agent has exited. It
also reads from the log the step the workers stopped at, the preemption snapshot's commit time,
and checks that the snapshot of that step exists. The time must fit torchrun's default
``--shutdown-timeout`` of 30 s, after which torchrun SIGKILLs the workers.

    PYTHONPATH=. .venv/bin/python benchmarks/preemption.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time

from elastictrain.storage.snapshot_store import SnapshotStore
from tests.helpers import procs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
JOBS = {
    "default job": ["train.log_every_steps=10"],
    "~200 MB state": ["task.factory=benchmarks._big_task:build", "train.batch_size=16", "train.max_epochs=100",
                      "snapshot.durable.every_steps=0", "train.log_every_steps=2", "log.plots=false"],
}
COMMITTED = re.compile(r"snapshot \S+/step-(\d+) committed: (\d+) bytes in ([\d.]+)s")


def trial(name: str, overrides: list[str], workdir: pathlib.Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=0", "-m", "elastictrain", "train",
               f"run.dir={workdir}", *overrides]
    job = procs.launch(command, log_path=workdir / "job.log", env={"PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT)
    try:
        job.wait_for(lambda out: re.search(r"INFO step \d+ epoch", out) is not None, 300, "training")
        sent = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)
        job.wait(120)
        exited_s = time.monotonic() - sent
    finally:
        procs.kill_all_launched()
    output = job.output()
    stopped = re.search(r"preempted at step (\d+): snapshot committed", output)
    commit = COMMITTED.findall(output)[-1]
    newest = SnapshotStore(str(workdir / "snapshots")).latest_valid()[0].step
    return {"job": name, "signal_to_exit_s": exited_s, "stopped_at_step": int(stopped.group(1)) if stopped else None,
            "snapshot_bytes": int(commit[1]), "snapshot_commit_s": float(commit[2]),
            "newest_valid_snapshot": newest, "zero_lost_steps": stopped is not None and newest == int(stopped.group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "preemption.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            for name, overrides in JOBS.items():
                rows.append(trial(name, overrides, pathlib.Path(tmp) / f"{i}-{len(rows)}"))
    print("| job | trials | signal -> all exited, s (median, max) | snapshot MB | commit s (median) | zero lost steps |")
    print("|---|---|---|---|---|---|")
    for name in JOBS:
        mine = [r for r in rows if r["job"] == name]
        exits = [r["signal_to_exit_s"] for r in mine]
        print(f"| {name} | {len(mine)} | {statistics.median(exits):.2f}, {max(exits):.2f} | "
              f"{mine[0]['snapshot_bytes'] / 1e6:.1f} | {statistics.median(r['snapshot_commit_s'] for r in mine):.2f} | "
              f"{sum(r['zero_lost_steps'] for r in mine)}/{len(mine)} |")
    pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
