"""TEST HARNESS, until the loop builds these itself: `elastictrain train` with a Watchdog and a StragglerReport.

Run as ``python -m tests.helpers.watched_job OVERRIDES`` (under torchrun or alone). It attaches
the observers the way the loop is to: every rank gets both, ``watchdog.beat(step)`` once per
optimizer step (here from the training loss call, at the start of each step), the gradient sync
timer on the DDP model after SETUP, and each rank's wait per step gathered at every log interval
(here by one extra all_reduce; the loop is to carry it in its metrics reduce).
Settings come as JSON in ``ELASTICTRAIN_TEST_WATCHDOG`` and ``ELASTICTRAIN_TEST_STRAGGLERS``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from elastictrain import Trainer
from elastictrain.config import load_config
from elastictrain.errors import ElastictrainError
from elastictrain.events import Observer, TrainInterval
from elastictrain.snapshot import seed_rng
from elastictrain.states import State
from elastictrain.stragglers import GradientSyncTimer, StragglerReport, StragglerSettings
from elastictrain.task import load_task
from elastictrain.watchdog import Watchdog, WatchdogSettings


class _GatherSyncWaits(Observer):
    """What the loop's metrics reduce is to do: every rank's wait per step, next to its step time."""

    def __init__(self, timer: GradientSyncTimer, report: StragglerReport) -> None:
        self.timer, self.report = timer, report

    def trained(self, interval: TrainInterval) -> None:
        world = len(interval.step_time_s_by_rank)
        waits = torch.zeros(world, dtype=torch.float64)
        if torch.distributed.is_initialized():
            waits[torch.distributed.get_rank()] = self.timer.take()
            torch.distributed.all_reduce(waits)
        self.report.observe(interval.step, interval.step_time_s_by_rank, waits.tolist())


def main(overrides: list[str]) -> int:
    cfg = load_config(None, overrides)
    seed_rng(cfg.run.seed)
    task = load_task(cfg.task)
    watchdog = Watchdog(WatchdogSettings(**json.loads(os.environ.get("ELASTICTRAIN_TEST_WATCHDOG", "{}"))))
    report = StragglerReport(StragglerSettings(**json.loads(os.environ.get("ELASTICTRAIN_TEST_STRAGGLERS", "{}"))))
    timer = GradientSyncTimer()
    trainer: Trainer | None = None
    user_loss = task.loss_fn
    first_step: list[int] = []  # the step this process began training at

    def loss_with_beat(model, batch):
        # The loop is to beat after each step; the start of step k+1 is the same moment, once a
        # step of this process is done.
        if model.training:
            step = trainer.progress.global_step
            first_step[:] = first_step or [step]
            if step != first_step[0]:
                watchdog.beat(step)
        return user_loss(model, batch)

    task.loss_fn = loss_with_beat
    trainer = Trainer.from_task(task, cfg, observers=[watchdog, report, _GatherSyncWaits(timer, report)])
    trainer.on(dst=State.RESTORE)(lambda src, dst, step: timer.register(trainer.model))
    try:
        trainer.fit()
    except ElastictrainError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
