"""What self-healing costs: step time with the anomaly checks on (the default) against off, and one rollback.

1. Step time: the step-overhead job (``_overhead_worker.py``: a Trainer, snapshots off) under real
   ``torchrun --nproc-per-node=2`` with ``anomaly.policy=rollback`` (the default: the gradient norm and the
   loss checked before every optimizer step) and with ``anomaly.policy=off``, as interleaved pairs whose
   order alternates. Reported: the median over pairs of on / off (target <= 1.01).
2. The check alone, in one process (one intra-op thread, as torchrun gives each worker): the same model's
   step (forward, backward, AdamW) in blocks of 20, alternately with and without what the check adds
   (``norms.grad_norm`` over the gradients and reading the loss); the median over blocks of with /
   without. Less noise than (1), whose pairs scatter by +-15 % on a busy machine.
3. One rollback: the custom loop of the self-healing tests (``tests/helpers/healing_loop.py``) with a
   transient fault on rank 1 at step 7, durable snapshots every 5 steps, once with the fast tier (node
   memory, /dev/shm) and once without; the seconds its goodput counts as ``rollback`` (the ROLLBACK state:
   the vote's gather, the restore) and as ``recompute`` (the steps replayed), from the final snapshot.

    PYTHONPATH=. .venv/bin/python benchmarks/anomaly_cost.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from step_overhead import run_job  # noqa: E402  (launch, wait for the result, reap)
from tests.helpers import procs  # noqa: E402

WORKER = pathlib.Path(__file__).resolve().with_name("_overhead_worker.py")
MODES = {"off": {"anomaly": {"policy": "off"}}, "on": {}}
STEPS = {"tiny": 600, "wide": 200}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0"]


def env_with(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def step_time(mode: str, model: str, workdir: pathlib.Path) -> float:
    out = workdir / f"{mode}-{model}-{time.time_ns()}.json"
    command = [*TORCHRUN, str(WORKER), "--mode=elastictrain", f"--model={model}", f"--steps={STEPS[model]}",
               f"--out={out}", f"--run-dir={workdir / f'run-{time.time_ns()}'}"]
    return run_job(command, env_with(OVERHEAD_CONFIG=json.dumps(MODES[mode])), out, f"{mode} on {model}", workdir)["step_s"]


def check_alone(model_name: str, blocks: int = 12, steps: int = 20) -> float:
    import torch.nn.functional as F

    from _overhead_worker import MODELS, dataset  # the step-overhead job's models and data
    from elastictrain.health.norms import grad_norm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = dataset(model_name, 32).tensors
    params = list(model.parameters())

    def block(check: bool) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            if check:
                grad_norm(params)
                float(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    block(False)
    ratios = []
    for repeat in range(blocks):
        order = (True, False) if repeat % 2 else (False, True)
        timed = {check: block(check) for check in order}
        ratios.append(timed[True] / timed[False])
    return statistics.median(ratios)


def one_rollback(workdir: pathlib.Path, fast_tier: bool) -> dict[str, float]:
    run_dir = workdir / f"rollback-{'fast' if fast_tier else 'durable'}"
    overrides = [f"run.dir={run_dir}", "train.max_epochs=1"]
    if fast_tier:
        overrides.append(f"snapshot.local.url=/dev/shm/elastictrain-bench-{os.getpid()}")
    job = procs.launch([*TORCHRUN, str(REPO_ROOT / "tests" / "helpers" / "healing_loop.py"), *overrides],
                       log_path=workdir / f"{run_dir.name}.log", env=env_with(HEAL_FAULT=f"7:1:{workdir}"), cwd=REPO_ROOT)
    try:
        assert job.wait(300) == 0, job.output()[-3000:]
    finally:
        job.kill_all()
    (workdir / "fault.done").unlink()
    assert "replayed clean" in job.output(), job.output()[-3000:]
    shown = subprocess.run([sys.executable, "-m", "elastictrain", "snapshots", "show", str(run_dir / "snapshots"), "--json"],
                           capture_output=True, text=True, env=env_with(), check=True).stdout
    seconds = json.loads(shown)["goodput"]["seconds_by_cause"]
    return {"rollback_s": seconds["rollback"], "recompute_s": seconds["recompute"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "anomaly_cost.json"))
    args = parser.parse_args()
    results: dict = {"load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        for model in STEPS:
            times = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                for mode in (list(MODES) if repeat % 2 == 0 else list(MODES)[::-1]):
                    times[mode].append(step_time(mode, model, workdir))
            ratios = [on / off for on, off in zip(times["on"], times["off"], strict=True)]
            results[model] = {"off_step_ms": [t * 1e3 for t in times["off"]], "on_step_ms": [t * 1e3 for t in times["on"]],
                              "ratios": ratios, "median_ratio": statistics.median(ratios)}
        results["check_alone"] = {model: check_alone(model) for model in STEPS}
        results["rollback"] = {"fast_tier": one_rollback(workdir, True), "durable_only": one_rollback(workdir, False)}
    results["load_after"] = os.getloadavg()[0]
    print("| model | off step ms (median) | on step ms (median) | median of paired on/off | target |")
    print("|---|---|---|---|---|")
    for model in STEPS:
        r = results[model]
        print(f"| {model} | {statistics.median(r['off_step_ms']):.3f} | {statistics.median(r['on_step_ms']):.3f} "
              f"| {r['median_ratio']:.3f} | <= 1.01 {'met' if r['median_ratio'] <= 1.01 else 'NOT met'} |")
    for model, ratio in results["check_alone"].items():
        print(f"the check alone, one process, {model}: {ratio:.3f} x the step without it")
    for tier, r in results["rollback"].items():
        print(f"one rollback ({tier}): {r['rollback_s']:.3f} s in ROLLBACK, {r['recompute_s']:.3f} s replaying")
    print(f"load average: {results['load_before']:.1f} before, {results['load_after']:.1f} after")
    pathlib.Path(args.out).write_text(json.dumps({"torch": torch.__version__, "python": platform.python_version(),
                                                  "repeats": args.repeats, "results": results}, indent=2))


if __name__ == "__main__":
    main()
