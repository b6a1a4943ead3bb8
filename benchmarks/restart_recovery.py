"""Measure whether a torchrun job recovers from a SIGKILL with the textbook process-group init and with elastictrain's.

What it measures. Each trial starts a real 2-worker job, ``torchrun --rdzv-backend=c10d
--max-restarts=3``, whose workers train a small DDP model (``benchmarks/_restart_worker.py``).
When rank 1 of the first attempt reaches step 5 it writes its pid, and this script SIGKILLs
that pid from outside. The trial then waits for the agent, up to ``--hang-timeout-s``:

- ``recovered``: agent exit code 0 and both ranks printed ``done``; ``restarts`` is the
  restart count of the attempt that finished (1 is ideal: one kill, one restart);
- ``failed``: the agent exited non-zero in time (for instance, all restarts used up);
- ``hung``: still running at the timeout; everything is then SIGKILLed.

It also counts the logs that contain gloo's ``connectFullMesh`` or ``Connection refused``:
the sign of a restarted rank reading the dead attempt's addresses from the agent's store
(see the docstring of ``elastictrain/dist/group.py``). The two modes differ only in the init:
``textbook`` is ``dist.init_process_group("gloo")``, ``elastictrain`` is
``elastictrain.dist.group.setup``.

Run it from the repository root (about 1 to 2 minutes per trial pair; a hang costs the timeout):

    PYTHONPATH=. .venv/bin/python benchmarks/restart_recovery.py --trials 12 --hang-timeout-s 40

Why interleaved. Trial i runs ``textbook`` and then ``elastictrain`` before trial i+1
starts. Whether a restarted rank wins or loses its race against stale store keys depends on
scheduling, so load on the machine (other jobs, a busy 2-core CI box) changes the outcome
rates and the timings. Interleaving spreads any drift in load evenly over both modes instead
of giving one mode the quiet minutes and the other the busy ones.

The table and a JSON file (``--out``) are written at the end. The log of any elastictrain
trial that did not recover with exactly one restart is kept next to the JSON, as
``restart_recovery-elastictrain-trial<N>-<outcome>.log``.
"""

from __future__ import annotations

import argparse
import json
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
from dataclasses import asdict, dataclass

import torch

from tests.helpers import procs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = pathlib.Path(__file__).resolve().with_name("_restart_worker.py")
MODES = ("textbook", "elastictrain")
MAX_RESTARTS = 3
# Importing torch twice over on a busy 2-core machine can take a while before step 5.
START_TIMEOUT_S = 180.0

DONE_LINE = re.compile(r"^rank (\d+) restart (\d+) done\s*$", re.MULTILINE)
PROGRESS_LINE = re.compile(r"^rank \d+ restart (\d+) (?:step \d+|done)\s*$", re.MULTILINE)
MESH_ERROR_LINE = re.compile(r"^.*(?:connectFullMesh|Connection refused).*$", re.MULTILINE)


@dataclass
class TrialResult:
    mode: str
    trial: int
    outcome: str  # recovered | failed | hung
    restarts: int | None  # restart count of the attempt in which both ranks finished
    highest_restart_seen: int | None  # highest restart count in any progress line
    agent_exit_code: int | None  # None when hung (killed by us)
    kill_to_end_s: float | None  # None when the job ended before the kill could be sent
    killed: bool
    mesh_error_in_log: bool
    # Evidence kept in the JSON. Rank 0's "Connection reset/closed by peer" right after the
    # kill is expected in both modes, so it is not what is kept here.
    first_mesh_error_line: str | None
    last_progress_line: str | None  # for a hang: how far the last attempt got
    kept_log: str | None


def torchrun_command(mode: str, workdir: pathlib.Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        f"--max-restarts={MAX_RESTARTS}", "--monitor-interval=0.1",
        str(WORKER), "--init", mode, "--workdir", str(workdir),
    ]


def run_trial(mode: str, trial: int, scratch: pathlib.Path, hang_timeout_s: float, results_dir: pathlib.Path) -> TrialResult:
    procs.ensure_none_running(WORKER, f"before trial {trial} ({mode})")
    workdir = scratch / f"trial{trial:02d}-{mode}"
    workdir.mkdir()
    log_path = workdir / "torchrun.log"
    launched = procs.launch(
        torchrun_command(mode, workdir),
        log_path=log_path,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
    )
    killed = False
    exit_code: int | None = None
    kill_to_end_s: float | None = None
    try:
        try:
            victim_pid = int(procs.wait_for_file(workdir / "kill-me.pid", START_TIMEOUT_S, launched))
        except AssertionError:
            # The job ended (or stalled) before rank 1 reached step 5: nothing was killed.
            exit_code = launched.proc.returncode
        else:
            os.kill(victim_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            killed = True
            try:
                exit_code = launched.wait(hang_timeout_s)
            except AssertionError:
                exit_code = None  # hung: wait() has SIGKILLed the whole tree
            kill_to_end_s = round(time.monotonic() - killed_at, 2)
    finally:
        # Workers run in sessions of their own: kill every pid ever seen under the agent.
        procs.kill_all_launched()
    if launched.leftover_pids():
        raise RuntimeError(f"trial {trial} ({mode}): pids {launched.leftover_pids()} survived SIGKILL")

    output = launched.output()
    done_restarts = {int(rank): int(restart) for rank, restart in DONE_LINE.findall(output)}
    seen_restarts = [int(restart) for restart in PROGRESS_LINE.findall(output)]
    if killed and exit_code is None:
        outcome = "hung"
    elif killed and exit_code == 0 and set(done_restarts) == {0, 1}:
        outcome = "recovered"
    else:
        outcome = "failed"
    mesh_error_line = MESH_ERROR_LINE.search(output)
    progress_lines = [match.group(0).strip() for match in PROGRESS_LINE.finditer(output)]
    result = TrialResult(
        mode=mode,
        trial=trial,
        outcome=outcome,
        restarts=max(done_restarts.values()) if outcome == "recovered" else None,
        highest_restart_seen=max(seen_restarts) if seen_restarts else None,
        agent_exit_code=exit_code,
        kill_to_end_s=kill_to_end_s,
        killed=killed,
        mesh_error_in_log=mesh_error_line is not None,
        first_mesh_error_line=mesh_error_line.group(0).strip()[:300] if mesh_error_line else None,
        last_progress_line=progress_lines[-1] if progress_lines else None,
        kept_log=None,
    )
    if mode == "elastictrain" and not (outcome == "recovered" and result.restarts == 1):
        kept = results_dir / f"restart_recovery-elastictrain-trial{trial:02d}-{outcome}.log"
        shutil.copyfile(log_path, kept)
        result.kept_log = str(kept.relative_to(REPO_ROOT)) if kept.is_relative_to(REPO_ROOT) else str(kept)
    return result


def summarise(results: list[TrialResult], mode: str) -> dict:
    of_mode = [r for r in results if r.mode == mode]
    recovered = [r for r in of_mode if r.outcome == "recovered"]
    recovered_times = [r.kill_to_end_s for r in recovered if r.kill_to_end_s is not None]
    return {
        "trials": len(of_mode),
        "recovered": len(recovered),
        "recovered_with_1_restart": sum(r.restarts == 1 for r in recovered),
        "recovered_with_more_restarts": sum((r.restarts or 0) > 1 for r in recovered),
        "failed": sum(r.outcome == "failed" for r in of_mode),
        "hung": sum(r.outcome == "hung" for r in of_mode),
        "median_kill_to_done_s_of_recovered": round(statistics.median(recovered_times), 2) if recovered_times else None,
        "logs_with_connectFullMesh_or_refused": sum(r.mesh_error_in_log for r in of_mode),
    }


def format_table(summary: dict[str, dict]) -> str:
    headers = ["mode", "trials", "recovered", "1 restart", ">1 restarts", "failed", "hung",
               "median kill->done s", "logs with connectFullMesh/refused"]
    keys = ["trials", "recovered", "recovered_with_1_restart", "recovered_with_more_restarts", "failed", "hung",
            "median_kill_to_done_s_of_recovered", "logs_with_connectFullMesh_or_refused"]
    rows = [[mode] + ["-" if stats[key] is None else str(stats[key]) for key in keys] for mode, stats in summary.items()]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [headers, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="kills per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="comma separated, run in this order in every trial")
    parser.add_argument("--hang-timeout-s", type=float, default=45.0, help="wait this long after the kill, then call it hung")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "benchmarks" / "results" / "restart_recovery.json")
    args = parser.parse_args()
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    results_dir = args.out.resolve().parent
    results_dir.mkdir(parents=True, exist_ok=True)

    started_at = time.time()
    started_s = time.monotonic()
    results: list[TrialResult] = []
    with tempfile.TemporaryDirectory(prefix="restart-recovery-") as scratch:
        for trial in range(args.trials):
            for mode in modes:
                result = run_trial(mode, trial, pathlib.Path(scratch), args.hang_timeout_s, results_dir)
                results.append(result)
                print(
                    f"trial {trial} {mode}: {result.outcome} restarts={result.restarts} "
                    f"kill->end={result.kill_to_end_s}s mesh_error={result.mesh_error_in_log}",
                    file=sys.stderr, flush=True,
                )
    procs.ensure_none_running(WORKER, "after the last trial")
    total_wall_s = round(time.monotonic() - started_s, 1)

    summary = {mode: summarise(results, mode) for mode in modes}
    print(format_table(summary))
    print(f"total wall time {total_wall_s} s")
    report = {
        "benchmark": "restart_recovery",
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "started_unix_s": round(started_at, 1),
        "total_wall_s": total_wall_s,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "settings": {
            "trials": args.trials, "modes": modes, "hang_timeout_s": args.hang_timeout_s,
            "max_restarts": MAX_RESTARTS, "torchrun": torchrun_command("<mode>", pathlib.Path("<workdir>"))[1:],
        },
        "summary": summary,
        "trials": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
