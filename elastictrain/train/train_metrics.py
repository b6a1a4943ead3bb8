"""The training metrics between two reduces: sample-weighted sums, step times, and the reduce that
makes them every rank's (recorded in the history as ``train_<name>``, reported to observers).

Each rank's mean step time, and its wait in the gradient all-reduce, ride in slots of their own in
the metrics' all_reduce: rank 0 sees every rank's (stragglers) without a collective of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastictrain.core.errors import UsageError
from elastictrain.core.events import Observers, TrainInterval
from elastictrain.dist.group import DistContext
from elastictrain.dist.reduce import WeightedSums
from elastictrain.dist.sync_timer import GradientSyncTimer
from elastictrain.train.runstate import RunState
from elastictrain.train.task import is_scalar


def check_logged(call: str, values: Mapping[str, Any]) -> None:
    """Values logged by ``session.step()``/``session.log()`` are scalars: one line naming the key, not a traceback."""
    for name, value in values.items():
        if not is_scalar(value):
            raise UsageError(
                f"{call}({name}=...) got {_described(value)}; logged values are scalars, the mean over "
                f"the step's samples: pass {name}=x.mean()"
            )


def evaluation_record(returned: Any) -> dict[str, Any]:
    """What the function given to ``session.evaluate_with()`` returned, as the history's ``val_<name>`` record."""
    if not isinstance(returned, Mapping):
        raise UsageError(
            f"the function given to session.evaluate_with() returned {_described(returned)}; it returns a "
            "dict of metric names to numbers, e.g. {'loss': 0.31, 'accuracy': 0.92}"
        )
    for name, value in returned.items():
        if not is_scalar(value):
            raise UsageError(
                f"the function given to session.evaluate_with() returned {name!r} as {_described(value)}; "
                f"metrics are scalars: return {{{name!r}: x.mean()}}"
            )
    return {f"val_{name}": value for name, value in returned.items()}


def _described(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__} of shape {tuple(shape)}" if shape is not None else f"a {type(value).__name__}"


@dataclass
class _Interval:
    """The log interval in progress: where it started and the time spent inside optimizer steps."""

    start_step: int
    started: float
    step_time_s: float = 0.0


class TrainMetrics:
    def __init__(
        self,
        ctx: DistContext,
        run: RunState,
        events: Observers,
        sync_timer: GradientSyncTimer,
        lr: Callable[[], float | None],
    ) -> None:
        self.ctx, self.run, self.events, self.sync_timer, self.lr = ctx, run, events, sync_timer, lr
        self.sums = WeightedSums(ctx.device)
        self.interval = _Interval(0, time.monotonic())

    def begin(self) -> None:
        """RESTORE: the first interval starts at the restored step."""
        self.interval = _Interval(self.run.progress.global_step, time.monotonic())

    def discard(self) -> None:
        """ROLLBACK, before the restore: the values since the last reduce are replayed (the snapshot restores its own)."""
        self.sums.discard()

    def add(self, samples: int, values: dict[str, Any]) -> None:
        self.sums.add(samples, values)

    def stepped(self, seconds: float) -> None:
        self.interval.step_time_s += seconds

    @property
    def pending(self) -> bool:
        return self.sums.steps > 0

    def reduce(self, samples_per_step: int) -> None:
        interval, now, step = self.interval, time.monotonic(), self.run.progress.global_step
        steps = step - interval.start_step
        world, rank = self.ctx.world_size, self.ctx.rank
        slots = [0.0] * (2 * world)
        slots[rank] = interval.step_time_s / steps if steps else 0.0
        slots[world + rank] = self.sync_timer.take()
        means, slots = self.sums.reduce(self.ctx, slots)
        self.interval = _Interval(step, now)
        if not means:
            return
        self.events.trained(
            TrainInterval(
                step=step,
                epoch=self.run.progress.epoch,
                steps=steps,
                samples=steps * samples_per_step,
                elapsed_s=now - interval.started,
                metrics=self.record(means),
                step_time_s_by_rank=slots[:world],
                sync_wait_s_by_rank=slots[world:],
            )
        )

    def record(self, means: dict[str, float]) -> dict[str, float]:
        """The history record of the training metrics reduced at this step (a log interval, or a survivor copy's)."""
        return self.run.record_train_means(means, self.lr())
