"""What a snapshot of a multi-GB state costs training on one GPU: elastictrain against DCP's async_save, one run.

One process trains an MLP of ``--params`` parameters with Adam (the snapshot holds the weights and both
moments: 12 bytes a parameter in fp32, ~12 GB at the default 1e9) on ``--device``, in turn:

- ``off``: elastictrain's Trainer, no snapshot (the step time the others are compared with);
- ``durable_async``: the Trainer with ``snapshot.durable.async_write=true`` to a local directory (``--dir``);
- ``fast_tier``: the Trainer with the node-local tier only (``snapshot.local.url`` under /dev/shm), in the background;
- ``dcp``: the same model and optimizer in a plain loop, saved with ``torch.distributed.checkpoint.async_save``
  and, on CUDA, torch's ``DefaultStager`` with pinned memory, a side stream and non-blocking copies (the
  zero-overhead checkpointing torchtitan uses); on the CPU the stager's CUDA options are off (they need CUDA).

Each snapshot is taken after step ``--every``, ``2 x --every``, ...; every step is timed from one forward to the
next (on CUDA the timer waits for the training stream first, so a step's time is the device's). ``dist.deterministic``
(on by default) holds for every mode: the first Trainer sets it for the process. For each mode it
reports the training time blocked per snapshot (elastictrain's SnapshotReport.duration_s; for DCP the time
async_save takes to return plus the wait for its staging before the next optimizer step and for its previous
upload before the next save), and the slowdown of the steps around each snapshot against the median of the
steps away from any: the step that contains the snapshot (``at_snapshot``) and the two after it (``after``,
where the background write or the device-to-host copies compete with training). The issue's target: blocked
time no larger than DCP's, and the steps around a snapshot within 2 % of the others.

    python benchmarks/gpu_snapshot.py --device cuda --params 1e9          # on a GPU (benchmarks/gpu/run_all.sh)
    python benchmarks/gpu_snapshot.py --device cpu --params 1e6 --steps 12 --every 4   # the script itself, tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain import Task, Trainer
from elastictrain.core.events import Observer

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
SHM = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else pathlib.Path(tempfile.gettempdir())
MODES = ("off", "durable_async", "fast_tier", "dcp")
FEATURES = 64
WARMUP_STEPS = 3  # the first steps (allocations, cuBLAS handles, autotuning) count for no baseline


def shape_for(params: float) -> tuple[int, int]:
    """(width, hidden layers) of an MLP of about ``params`` parameters: width a multiple of 256, at most 8192."""
    width = max(256, min(8192, int(math.sqrt(params / 4)) // 256 * 256))
    return width, max(1, round(params / (width * width)))


def build_model(params: float, device: torch.device) -> nn.Module:
    width, layers = shape_for(params)
    torch.manual_seed(0)
    with device:  # parameters made on the device: no multi-GB copy from the host
        blocks = [nn.Linear(FEATURES, width), nn.ReLU()]
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*blocks, nn.Linear(width, 10))


def data(steps: int, batch: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    samples = (steps + 1) * batch
    return TensorDataset(torch.randn(samples, FEATURES, generator=generator), torch.randint(0, 10, (samples,), generator=generator))


def loss_of(module: nn.Module, batch) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(module(inputs), labels)


class StepClock:
    """Time stamps at the start of every forward; on CUDA once the training stream has finished what came before.

    Only the current stream is waited for, not the device: a stager's copies on a side stream (DCP's) go on
    behind the stamp, as they would in training.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def tick(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.stamps.append(time.perf_counter())

    def step_times(self) -> list[float]:
        """Index i: from the forward of step i+1 to that of step i+2 (a snapshot after step s is in index s-1)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class Reports(Observer):
    def __init__(self) -> None:
        self.reports = []

    def snapshotted(self, report) -> None:
        self.reports.append(report)


def around_snapshots(step_times: list[float], snapshot_steps: list[int]) -> dict:
    """The steps that hold a snapshot and the two after it, against the median of the steps away from any."""
    near = {index for step in snapshot_steps for index in range(step - 1, step + 2)}
    baseline = [t for i, t in enumerate(step_times) if i >= WARMUP_STEPS and i not in near]
    median = statistics.median(baseline) if baseline else float("nan")
    at = [step_times[s - 1] for s in snapshot_steps if s - 1 < len(step_times)]
    after = [step_times[i] for s in snapshot_steps for i in (s, s + 1) if i < len(step_times)]
    return {
        "baseline_step_s": median,
        "baseline_steps": len(baseline),
        "at_snapshot_step_s": at,
        "after_snapshot_step_s": after,
        "at_snapshot_slowdown": (statistics.mean(at) / median - 1) if at and baseline else None,
        "after_snapshot_slowdown": (statistics.mean(after) / median - 1) if after and baseline else None,
    }


def run_trainer(mode: str, args, device: torch.device, workdir: pathlib.Path) -> dict:
    model = build_model(args.params, device)
    task = Task(model, torch.optim.Adam(model.parameters(), lr=1e-5), data(args.steps, args.batch), loss_of)
    clock = StepClock(device)

    def timed_loss(module, batch):
        clock.tick()
        return loss_of(module, batch)

    task.loss_fn = timed_loss
    run_dir = workdir / f"run-{mode}"
    local_url = SHM / f"gpu-snapshot-{os.getpid()}"
    reports = Reports()
    trainer = Trainer.from_task(task, {
        "run": {"dir": str(run_dir)},
        "dist": {"device": str(device)},
        "train": {"max_epochs": 1, "max_steps": args.steps, "batch_size": args.batch, "log_every_steps": 10_000},
        "snapshot": {
            "durable": {"every_steps": args.every if mode == "durable_async" else 0, "on_done": False, "keep_last": 1,
                        "async_write": True, "lease_stale_after_s": 0},
            "local": {"url": str(local_url) if mode == "fast_tier" else None, "every_steps": args.every,
                      "keep_last": 1, "survivor_copies": False}},
        "log": {"progress_bar": False, "plots": False, "level": "WARNING"},
    }, observers=[reports])
    trainer.fit()
    clock.tick()  # the end of the last step
    del trainer, task, model
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(local_url, ignore_errors=True)
    committed = [r for r in reports.reports if r.committed]
    return {
        "snapshots": len(committed),
        "snapshot_steps": [r.step for r in committed],
        "snapshot_bytes": committed[0].size_bytes if committed else 0,
        "blocked_s": [r.duration_s for r in committed],
        "write_s": [r.write_s for r in committed],
        **around_snapshots(clock.step_times(), [r.step for r in committed]),
    }


def run_dcp(args, device: torch.device, workdir: pathlib.Path) -> dict:
    """The same model, optimizer and batches in a plain loop, saved with DCP's async_save every ``--every`` steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    on_cuda = device.type == "cuda"
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True: one process, as meant
    # Pinned memory, a staging thread and non-blocking copies need CUDA (DCP raises without it); shared memory is
    # for the process executor, and this is the thread one.
    stager = DefaultStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=False,
                                          use_async_staging=on_cuda, use_non_blocking_copy=on_cuda))
    model = build_model(args.params, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    loader = torch.utils.data.DataLoader(data(args.steps, args.batch), batch_size=args.batch)
    clock = StepClock(device)
    blocked, snapshot_steps, pending = [], [], None  # pending: (staging future or None, upload future, blocked so far)
    checkpoints = []
    try:
        for step, batch in enumerate(loader, start=1):
            if step > args.steps:
                break
            clock.tick()
            inputs, labels = (tensor.to(device, non_blocking=True) for tensor in batch)
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, (inputs, labels)).backward()
            if pending is not None and pending[0] is not None:  # the staged copy must be complete before the update
                waited = time.perf_counter()
                pending[0].result()
                blocked[-1] += time.perf_counter() - waited
                pending = (None, pending[1])
            optimizer.step()
            if step % args.every:
                continue
            started = time.perf_counter()
            if pending is not None:  # one upload at a time, as elastictrain writes one snapshot at a time
                pending[1].result()
            model_state, optim_state = get_state_dict(model, optimizer)
            checkpoint = workdir / f"dcp-step-{step}"
            response = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint),
                                      async_stager=stager, no_dist=True)
            if hasattr(response, "staging_completion"):  # an AsyncSaveResponse: staging continues in the background
                pending = (response.staging_completion, response.upload_completion)
            else:  # a Future of the upload: staging finished before async_save returned
                pending = (None, response)
            blocked.append(time.perf_counter() - started)
            snapshot_steps.append(step)
            checkpoints.append(checkpoint)
            for old in checkpoints[:-2]:  # keep the newest (and the one being written): the disk holds two states
                shutil.rmtree(old, ignore_errors=True)
        clock.tick()
        if pending is not None:
            pending[1].result()
        size = sum(f.stat().st_size for f in checkpoints[-1].rglob("*") if f.is_file()) if checkpoints else 0
    finally:
        stager.close()
        for checkpoint in checkpoints:
            shutil.rmtree(checkpoint, ignore_errors=True)
    return {
        "snapshots": len(blocked),
        "snapshot_steps": snapshot_steps,
        "snapshot_bytes": size,
        "blocked_s": blocked,
        "stager": "DefaultStager(pinned memory, async staging, non-blocking copies)" if on_cuda
                  else "DefaultStager(CUDA options off: no CUDA)",
        **around_snapshots(clock.step_times(), snapshot_steps),
    }


def summarise(results: dict) -> str:
    lines = [f"{'mode':<14} {'snapshots':>9} {'state GB':>9} {'blocked s (median)':>19} {'step s':>9} "
             f"{'at-snapshot':>12} {'after':>8}"]
    for mode, result in results.items():
        blocked = statistics.median(result["blocked_s"]) if result.get("blocked_s") else float("nan")
        at, after = result.get("at_snapshot_slowdown"), result.get("after_snapshot_slowdown")
        lines.append(f"{mode:<14} {result.get('snapshots', 0):>9} {result.get('snapshot_bytes', 0) / 1e9:>9.2f} "
                     f"{blocked:>19.4f} {result['baseline_step_s']:>9.4f} "
                     f"{'' if at is None else f'{at:+.1%}':>12} {'' if after is None else f'{after:+.1%}':>8}")
    return "\n".join(lines)


def default_out() -> pathlib.Path:
    out = os.environ.get("OUT")
    return pathlib.Path(out) / "gpu_snapshot.json" if out else REPO_ROOT / "benchmarks" / "results" / "gpu_snapshot.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=1e9, help="model parameters (the state is ~12 bytes each)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="a snapshot after every N steps")
    parser.add_argument("--modes", default=",".join(MODES), help=f"a comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--dir", default=None, help="where durable snapshots and DCP checkpoints go (default: a "
                                                    "temporary directory)")
    parser.add_argument("--out", default=None, help="the JSON results (default: $OUT/gpu_snapshot.json if OUT is set, "
                                                    "else benchmarks/results/gpu_snapshot.json)")
    args = parser.parse_args(argv)
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    if args.every >= args.steps or args.every <= WARMUP_STEPS:
        parser.error(f"--every must be above {WARMUP_STEPS} (warm-up steps) and below --steps")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available here; use --device cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    width, layers = shape_for(args.params)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="gpu-snapshot-", dir=args.dir))
    results = {}
    try:
        for mode in modes:
            started = time.perf_counter()
            results[mode] = run_dcp(args, device, workdir) if mode == "dcp" else run_trainer(mode, args, device, workdir)
            results[mode]["mode_wall_s"] = time.perf_counter() - started
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{mode}: done in {results[mode]['mode_wall_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "params": sum(p.numel() for p in build_model(args.params, torch.device("meta")).parameters()),
        "width": width, "hidden_layers": layers,
        "batch": args.batch, "steps": args.steps, "every": args.every,
        "results": results,
    }
    out = pathlib.Path(args.out) if args.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(summarise(results))
    print(f"results: {out}")
    return report


if __name__ == "__main__":
    main()
