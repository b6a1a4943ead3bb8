"""Test tasks: the built-in spirals task, small, with its sample order traced and a pause point for kills.

A test that kills a worker needs the kill to land at a known step: the traced loss function
writes its pid to a file and waits when it reaches ``pause_at_step`` on ``pause_rank``, the
first time only (the pid file marks that it happened), so the test's SIGKILL hits that step. A
test that sends a catchable signal instead lets the step go on by creating the ``.resume``
file next to the pid file. ``pauses`` adds more such points, ``[[rank, call], ...]``, each once per
job with its own marker ``paused-rank{rank}-call{call}.pid`` (a kill at one step, then a join at
another). ``raise_rank``/``raise_at_step`` make a worker raise (a user bug), once per job.

For hung and slow ranks: ``sleep_rank``/``sleep_at_step`` make a worker sleep forever inside its
loss function (once per job: the ``slept-rank{r}`` marker); ``step_sleep_s`` slows every
training step on every rank, ``slow_rank``/``slow_step_s`` one rank only. ``extra_metric_rank``
returns one more metric key (``rank_only``) on that rank only. ``poison`` makes one training sample NaN.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset

from elastictrain import Task
from elastictrain.train.tasks import spirals


class IndexedDataset(Dataset):
    """Each sample also carries its index, so tests can see which samples each step used."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        return (*self.inner[index], index)


class PoisonedDataset(Dataset):
    """One sample (``index``) has NaN inputs: a bad record in the data, the same at every read."""

    def __init__(self, inner: Dataset, index: int) -> None:
        self.inner, self.index = inner, index

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        points, label, index = self.inner[index]
        return (torch.full_like(points, float("nan")) if index == self.index else points), label, index


class JitteredDataset(Dataset):
    """Random augmentation in ``__getitem__``: each point moved by a fresh ``torch.randn`` draw, index kept."""

    def __init__(self, inner: Dataset, scale: float = 0.05) -> None:
        self.inner, self.scale = inner, scale

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        points, label, index = self.inner[index]
        return points + self.scale * torch.randn(points.shape), label, index


def build(trace_dir: str, pause_rank: int = -1, pause_at_step: int = -1, raise_rank: int = -1, raise_at_step: int = -1,
          sleep_rank: int = -1, sleep_at_step: int = -1, step_sleep_s: float = 0.0, slow_rank: int = -1,
          slow_step_s: float = 0.0, pauses: list[list[int]] = (), lr_factory: bool = False, extra_metric_rank: int = -1,
          thread_sensitive: bool = False, poison: int = -1, **spiral_args) -> Task:
    spiral_args = {"train_samples": 1536, "val_samples": 512, "hidden": 64, "lr_step": 100, **spiral_args}
    task = spirals.build(**spiral_args)
    rank = os.environ.get("RANK", "0")
    # One trace file per process, named so that sorting by name sorts by start time.
    trace_path = Path(trace_dir) / f"rank{rank}-{time.time_ns()}-pid{os.getpid()}.jsonl"
    pause_marker = Path(trace_dir) / f"paused-rank{pause_rank}.pid"
    # (call, marker) of this rank's extra pause points.
    more_pauses = [(call, Path(trace_dir) / f"paused-rank{r}-call{call}.pid") for r, call in pauses if str(r) == rank]
    raise_marker = Path(trace_dir) / f"raised-rank{raise_rank}"
    sleep_marker = Path(trace_dir) / f"slept-rank{sleep_rank}"
    calls = 0

    def traced_loss(model: torch.nn.Module, batch):
        nonlocal calls
        if model.training:
            calls += 1
            with trace_path.open("a") as trace:
                trace.write(json.dumps({"call": calls, "indices": batch[2].tolist()}) + "\n")
            if str(pause_rank) == rank and calls == pause_at_step:
                _pause_once(pause_marker)
            for call, marker in more_pauses:
                if calls == call:
                    _pause_once(marker)
            if str(raise_rank) == rank and calls == raise_at_step and not raise_marker.exists():
                raise_marker.touch()
                raise ValueError(f"a bug in the user's loss function at step {calls}")
            if str(sleep_rank) == rank and calls == sleep_at_step and not sleep_marker.exists():
                sleep_marker.touch()
                while True:  # a deadlock in user code: only the watchdog (or a kill) ends this
                    time.sleep(1)
            time.sleep(step_sleep_s + (slow_step_s if str(slow_rank) == rank else 0.0))
        loss, metrics = spirals.cross_entropy_with_accuracy(model, batch)
        if str(extra_metric_rank) == rank:
            metrics["rank_only"] = loss.detach()
        if thread_sensitive:
            # Scaled by a mean of 2M squares (~1.0): its last bits, and so every gradient's, depend on the
            # intra-op thread count, which splits the sum.
            loss = loss * _BIG.pow(2).mean()
        return loss, metrics

    trace_path.touch()
    if lr_factory:  # a schedule that must know the run's length: linear decay to zero at the last step
        def linear_decay(optimizer, total_steps):
            print(f"lr factory: total_steps={total_steps}", flush=True)
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total_steps))

        task.lr_scheduler = linear_decay
    task.train_data = IndexedDataset(task.train_data)
    if poison >= 0:
        task.train_data = PoisonedDataset(task.train_data, poison)
    task.val_data = IndexedDataset(task.val_data)
    task.loss_fn = traced_loss
    return task


# Reductions over 2M elements are split among intra-op threads (1M are not, in torch 2.13 on CPU).
_BIG = torch.randn(2_000_000, generator=torch.Generator().manual_seed(7))


def _pause_once(marker: Path) -> None:
    """Write this pid to ``marker`` and wait for ``<marker>.resume`` (or a kill); once per job: not if marker exists."""
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    resume = marker.with_suffix(".resume")
    deadline = time.monotonic() + 600
    while not resume.exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the test SIGKILLs or signals this process here


class SpiralStream(IterableDataset):
    """A stream of indexed spiral samples: each epoch a new order, rank r reads every W-th sample.

    Resumable the way streaming datasets are: ``state_dict()`` is (epoch, samples read by this
    rank), ``load_state_dict`` continues from there, ``set_epoch`` starts a new pass.
    """

    def __init__(self, inner: Dataset, seed: int = 0) -> None:
        self.inner, self.seed = inner, seed
        self.epoch, self.position = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        order = torch.randperm(len(self.inner), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        mine = order[rank::world]
        while self.position < len(mine):
            index = mine[self.position]
            self.position += 1
            yield (*self.inner[index], index)


def build_stream(trace_dir: str, **args) -> Task:
    """The traced task of ``build`` with its training set as a stream (1537 samples: uneven shards)."""
    task = build(trace_dir, **{"train_samples": 1537, **args})
    task.train_data = SpiralStream(task.train_data.inner)
    return task


def build_jittered(trace_dir: str, **args) -> Task:
    """The traced task of ``build`` whose training samples are jittered by torch.randn as they are fetched."""
    task = build(trace_dir, **args)
    task.train_data = JitteredDataset(task.train_data)
    return task


def read_traces(trace_dir: Path, rank: int) -> list[list[list[int]]]:
    """Per process of ``rank``, in start order: the sample indices of each training forward."""
    files = sorted(Path(trace_dir).glob(f"rank{rank}-*.jsonl"))
    return [[json.loads(line)["indices"] for line in f.read_text().splitlines()] for f in files]


def stitch(attempts: list[list[list[int]]], start_steps: list[int]) -> list[list[int]]:
    """The samples that count: each attempt continues from the step it restored, dropping redone steps."""
    assert len(attempts) == len(start_steps), (len(attempts), start_steps)
    steps: list[list[int]] = []
    for trace, start in zip(attempts, start_steps, strict=True):
        steps = steps[:start] + trace
    return steps
