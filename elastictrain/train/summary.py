"""What a run reports: rank 0's progress lines, the Prometheus exporter, the summary line every rank
computes at DONE, and rank 0's plots."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from elastictrain.core.config import Config
from elastictrain.core.errors import ElastictrainError
from elastictrain.core.events import Observers
from elastictrain.core.logs import ProgressReport
from elastictrain.core.states import State, StateMachine
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.format import params_sha256
from elastictrain.train.runstate import RunState

log = logging.getLogger("elastictrain")


@dataclass
class RunSummary:
    """What a finished worker reports: ``Trainer.fit()`` returns it, ``session.summary`` holds it at the end.

    ``params_sha256`` fingerprints the final model: equal between an unbroken and a resumed run on
    the same CPU type, torch build, thread count, config and world size (or ``train.virtual_shards``).
    """

    state: str
    global_step: int
    epoch: int
    world_size: int
    restart_count: int  # the launcher's restarts of this attempt (torchrun/SLURM)
    train_loss: float | None
    val_loss: float | None
    val_metrics: dict[str, float] = field(default_factory=dict)
    params_sha256: str = ""
    wall_s: float = 0.0  # this attempt
    attempts: int = 1  # launches and restarts of the whole run, relaunches included
    run_wall_s: float = 0.0  # every attempt's time up to its last snapshot, plus this attempt

    def line(self) -> str:
        """The one ``run summary: ...`` line the session logs at the end."""
        values = {"train_loss": self.train_loss, "val_loss": self.val_loss, **self.val_metrics}
        shown = "".join(f"{k}={v:.4f} " for k, v in values.items() if v is not None)
        return (
            f"run summary: state={self.state} step={self.global_step} epoch={self.epoch} "
            f"world_size={self.world_size} restart={self.restart_count} attempts={self.attempts} {shown}"
            f"wall_s={self.wall_s:.1f} run_wall_s={self.run_wall_s:.1f} params_sha256={self.params_sha256}"
        )


def summarize(
    state_name: str, run: RunState, model: nn.Module, world_size: int, restart_count: int, wall_s: float
) -> RunSummary:
    history, run_log = run.history, run.run_log
    last = history.records[-1] if history.records else {}
    return RunSummary(
        state=state_name,
        global_step=run.progress.global_step,
        epoch=run.progress.epoch,
        world_size=world_size,
        restart_count=restart_count,
        train_loss=history.last("train_loss"),
        val_loss=history.last("val_loss"),
        val_metrics={k: v for k, v in last.items() if k.startswith("val_") and k != "val_loss"},
        params_sha256=params_sha256(model),
        wall_s=wall_s,
        attempts=len(run_log.attempts),
        run_wall_s=run_log.total("wall_s") - run_log.current["wall_s"] + wall_s,
    )


def plot(run: RunState, run_dir: str, run_name: str) -> None:
    from elastictrain.observe.plots import write_plots

    out_dir = f"{run_dir}/plots"
    try:
        paths = write_plots(run.history.records, run.run_log.attempts, out_dir, run_name=run_name)
    except ElastictrainError as exc:  # matplotlib missing: the run itself is fine
        log.info("no plots: %s", exc)
        return
    except OSError as exc:  # a run.dir that cannot be written: the run and its snapshots are fine, it ends DONE
        log.warning(
            "no plots: %s cannot be written (%s); point run.dir at a writable directory, or set "
            "log.plots=false — the run finished and its snapshots are intact",
            out_dir,
            exc.strerror or exc,
        )
        return
    log.info("plots of %d metric(s) in %s", len(paths), out_dir)


def attach_reporters(cfg: Config, ctx: DistContext, events: Observers, machine: StateMachine, run: RunState) -> None:
    """Rank 0's progress report, plots and trackers (track.*); the exporter on rank 0 (and each node's local rank 0 with per_node)."""
    if ctx.is_main:
        events.add(ProgressReport(cfg.log))
        if cfg.log.plots:
            machine.on(dst=State.DONE)(lambda *_: plot(run, cfg.run_dir, cfg.run.name))
    metrics = cfg.metrics
    if metrics.port > 0 and (ctx.is_main or (metrics.per_node and ctx.env.local_rank == 0)):
        from elastictrain.observe.metrics import (
            PrometheusObserver,  # binds the port now: a port in use fails before training
        )

        events.add(PrometheusObserver(metrics, goodput=run.goodput, run_name=cfg.run.name))
    if ctx.is_main:
        from elastictrain.observe.trackers.exactly_once import attach_trackers

        attach_trackers(cfg, events, run)
    if (
        cfg.track.mlflow_uri
    ):  # rank 0 opens its tracker run in the background: its id reaches the others' snapshots later
        from elastictrain.observe.trackers.ids import share_run_id

        for snapshot in (State.SNAPSHOT, State.LOCAL_SNAPSHOT):  # every rank takes both at the same steps
            machine.on(dst=snapshot)(lambda *_: share_run_id(run.tracking, ctx))
