"""Prometheus exporter: an observer that serves the training's numbers at ``/metrics``.

Built by rank 0 (with ``metrics.per_node``, by each node's local rank 0) when ``metrics.port``
is set. It binds its port at construction, so a port in use is one clear error at start-up and
not a traceback in the middle of training. It keeps its own ``CollectorRegistry``: two trainers
in one process never clash, and nothing of the process-global registry leaks in.

Every metric carries ``run`` (the run name) and, with ``metrics.per_node``, ``node`` (the node
rank), so several jobs and nodes can share one Prometheus. Train and validation metrics are one
gauge each with a ``name`` label: their names come from the user's loss function, and a label
lets one dashboard panel show whatever metrics a task reports, without minting metric names
from user input.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from elastictrain.core.config import MetricsConfig
from elastictrain.core.errors import ConfigError
from elastictrain.core.events import Observer, RunInfo, SnapshotReport, Tier, TrainInterval
from elastictrain.core.states import State
from elastictrain.observe.goodput import Goodput
from elastictrain.observe.stragglers import compute_s_by_rank, others_median_s

PREFIX = "elastictrain_"
# Local-disk snapshots of small models take tens of milliseconds; large ones on object stores, minutes.
# Counters of this attempt's events (exported with the _total suffix), counted from 0 at start.
COUNTERS = {
    "snapshots": "Snapshots committed by this attempt.",
    "snapshot_failures": "Snapshots that failed to commit in this attempt.",
    "preemptions": "Preemption signals received by this attempt.",
}
# Anomalies (anomalies.py) by decision: skip, rollback (a replay started), data (it recurred: samples skipped),
# transient (the replay was clean). Rollbacks are rollback + data.
ANOMALY_DECISIONS = ("skip", "rollback", "data", "transient")
# At DONE, rank 0 waits for one more scrape (if it has ever been scraped), so Prometheus sees the run finish and
# ElastictrainMetricsGone (launch/monitoring/alerts.yml) tells a finished run from a lost one; this long at most.
FINAL_SCRAPE_WAIT_S = 30.0
SCRAPE_ANSWER_S = 0.2
SNAPSHOT_DURATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class PrometheusObserver(Observer):
    """Serve ``/metrics`` on ``cfg.host:cfg.port`` until ``closed()``; pass the run's ``Goodput`` to export it.

    ``port=0`` binds a free port (read it back from ``.port``); the loop only builds an exporter
    when ``metrics.port`` is set. ``run_name`` labels every metric (default: the run directory's name).
    """

    def __init__(self, cfg: MetricsConfig, goodput: Goodput | None = None, run_name: str | None = None) -> None:
        self.cfg = cfg
        self.goodput = goodput
        self.run_name = run_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._info: RunInfo | None = None
        self._labels: dict[str, str] = {}  # run (and node), known at started()
        self._scraped = threading.Condition()
        self._scrapes = 0  # scrapes served (counted by _ScrapeTimeCollector)
        self._scrapes_at_done: int | None = None
        self._create_metrics()
        self.registry.register(_ScrapeTimeCollector(self))
        try:
            self._server, self._thread = start_http_server(cfg.port, addr=cfg.host, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics.port={cfg.port} is already in use on {cfg.host}; pick another port or metrics.port=0"
                ) from None
            raise ConfigError(
                f"metrics.host={cfg.host} metrics.port={cfg.port} cannot be bound ({exc.strerror or exc}); "
                "set metrics.host to an address of this machine, or metrics.port=0"
            ) from None
        self.port: int = self._server.server_port

    def _create_metrics(self) -> None:
        base = ["run", "node"] if self.cfg.per_node else ["run"]

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, [*base, *extra], registry=self.registry)

        self.global_step = gauge("global_step", "Optimizer steps taken since the run began.")
        self.total_steps = gauge("total_steps", "Optimizer steps in the whole run at this world size.")
        self.epoch = gauge("epoch", "Current epoch (0-based; the count of finished epochs).")
        self.samples_per_second = gauge(
            "samples_per_second", "Global training samples per second over the last log interval."
        )
        self.steps_per_second = gauge("steps_per_second", "Optimizer steps per second over the last log interval.")
        self.train_metric = gauge(
            "train_metric", "Training loss and metrics, reduced over all ranks, last log interval.", ("name",)
        )
        self.learning_rate = gauge("learning_rate", "Learning rate of the first parameter group.")
        self.validation_metric = gauge(
            "validation_metric", "Validation loss and metrics over the whole validation set.", ("name",)
        )
        self.step_time = gauge(
            "step_time_seconds",
            "Mean optimizer step time of each rank over the last log interval "
            "(equal on all ranks under synchronous training: each waits for the slowest).",
            ("rank",),
        )
        # What the straggler log judges (stragglers.py): each rank's own compute, against the others' median.
        self.compute_time = gauge(
            "compute_time_seconds",
            "Each rank's mean compute per step over the last log interval: "
            "its step time minus its wait in the gradient all-reduce.",
            ("rank",),
        )
        self.compute_others_median = gauge(
            "compute_time_others_median_seconds",
            "The median of the other ranks' compute per step, what each rank's "
            "elastictrain_compute_time_seconds is judged against (2 ranks or more).",
            ("rank",),
        )
        self.state = gauge("state", "1 for the worker's current state, 0 for the others.", ("state",))
        self.world_size = gauge("world_size", "Workers in the process group.")
        self.restore_duration = gauge("restore_duration_seconds", "How long the last restore took.")
        self.snapshot_size = gauge("snapshot_size_bytes", "Size of the last committed snapshot.")
        self.last_snapshot_time = gauge("last_snapshot_timestamp_seconds", "Unix time the last snapshot was committed.")
        self.last_snapshot_step = gauge("last_snapshot_step", "Global step of the last committed snapshot.")
        # Counters are plain numbers exported by _ScrapeTimeCollector: no `_created` series
        # (an `elastictrain_snapshots_created` gauge would read like a count of snapshots).
        # The snapshot-duration histogram too (no `_seconds_created` series that reads like a duration).
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.snapshot_buckets = [0] * len(SNAPSHOT_DURATION_BUCKETS_S)  # rank 0's commits, cumulative per upper bound
        self.snapshot_duration_count, self.snapshot_duration_sum_s = 0, 0.0
        self.anomalies = dict.fromkeys(ANOMALY_DECISIONS, 0)

    # -- events -----------------------------------------------------------------------------

    def started(self, info: RunInfo) -> None:
        self._info = info
        self._labels = {"run": self.run_name or os.path.basename(os.path.normpath(info.run_dir))}
        if self.cfg.per_node:
            self._labels["node"] = str(info.node_rank)
        labels = self._labels
        self.world_size.labels(**labels).set(info.world_size)
        self.total_steps.labels(**labels).set(info.total_steps)
        self._set_state(State.SETUP)

    def transition(self, src: State, dst: State, step: int) -> None:
        if self._labels:  # the loop's first transition (SETUP -> RESTORE) comes after started()
            self._set_state(dst)
            self.global_step.labels(**self._labels).set(step)
        if dst is State.DONE:
            with self._scraped:
                self._scrapes_at_done = self._scrapes

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        self.global_step.labels(**self._labels).set(step)
        self.restore_duration.labels(**self._labels).set(duration_s)

    def trained(self, interval: TrainInterval) -> None:
        labels = self._labels
        self.global_step.labels(**labels).set(interval.step)
        self.epoch.labels(**labels).set(interval.epoch)
        if interval.elapsed_s > 0:
            self.samples_per_second.labels(**labels).set(interval.samples / interval.elapsed_s)
            self.steps_per_second.labels(**labels).set(interval.steps / interval.elapsed_s)
        for key, value in interval.metrics.items():
            if key == "lr":
                self.learning_rate.labels(**labels).set(value)
            else:
                self.train_metric.labels(**labels, name=key.removeprefix("train_")).set(value)
        for rank, step_time_s in enumerate(interval.step_time_s_by_rank):
            self.step_time.labels(**labels, rank=str(rank)).set(step_time_s)
        compute = compute_s_by_rank(interval.step_time_s_by_rank, interval.sync_wait_s_by_rank)
        for rank, compute_s in enumerate(compute):
            self.compute_time.labels(**labels, rank=str(rank)).set(compute_s)
        for rank, others_s in enumerate(others_median_s(compute)):
            self.compute_others_median.labels(**labels, rank=str(rank)).set(others_s)

    def evaluated(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.validation_metric.labels(**self._labels, name=key.removeprefix("val_")).set(value)

    def snapshotted(self, report: SnapshotReport) -> None:
        if report.tier is not Tier.DURABLE:  # the gauges describe what a relaunch anywhere can restore
            return
        labels = self._labels
        if not report.committed:
            self.counts["snapshot_failures"] += 1
            return
        self.counts["snapshots"] += 1
        self.last_snapshot_time.labels(**labels).set(time.time())
        self.last_snapshot_step.labels(**labels).set(report.step)
        # Only rank 0 writes the snapshot, so only it knows how long that took and how big it is.
        if self._info is not None and self._info.rank == 0:
            self.snapshot_buckets = [
                n + (report.duration_s <= bound) for n, bound in zip(self.snapshot_buckets, SNAPSHOT_DURATION_BUCKETS_S)
            ]
            self.snapshot_duration_count += 1
            self.snapshot_duration_sum_s += report.duration_s
            self.snapshot_size.labels(**labels).set(report.size_bytes)

    def preempt_requested(self, signal_name: str, step: int) -> None:
        self.counts["preemptions"] += 1

    def anomaly(self, entry: dict) -> None:
        self.anomalies[entry["decision"]] = self.anomalies.get(entry["decision"], 0) + 1

    def closed(self) -> None:
        with self._scraped:  # a finished run is scraped once as done (when anything scrapes it at all)
            if self._scrapes_at_done is not None and self._scrapes_at_done > 0:
                at_done = self._scrapes_at_done
                if self._scraped.wait_for(lambda: self._scrapes > at_done, timeout=FINAL_SCRAPE_WAIT_S):
                    time.sleep(SCRAPE_ANSWER_S)  # counted as it is collected: let its answer go out
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _set_state(self, current: State) -> None:
        for state in State:
            self.state.labels(**self._labels, state=state.value).set(1 if state is current else 0)


class _ScrapeTimeCollector(Collector):
    """What is read when Prometheus scrapes: the event counters, snapshot durations, the launcher's restart count, goodput."""

    def __init__(self, observer: PrometheusObserver) -> None:
        self.observer = observer

    def describe(self) -> list[Metric]:
        return []  # families appear once the run is known; nothing to check for name clashes up front

    def collect(self) -> Iterator[Metric]:
        with self.observer._scraped:
            self.observer._scrapes += 1
            self.observer._scraped.notify_all()
        info, labels = self.observer._info, self.observer._labels
        if info is None:
            return
        names, values = list(labels), list(labels.values())
        for name, documentation in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, documentation, labels=names)
            family.add_metric(values, self.observer.counts[name])
            yield family
        anomalies = CounterMetricFamily(
            PREFIX + "anomalies",
            "Non-finite or spiking steps in this attempt, by decision (skip, rollback: a replay "
            "began, data: it recurred and its samples are skipped, transient: the replay was clean).",
            labels=[*names, "decision"],
        )
        for decision, count in self.observer.anomalies.items():
            anomalies.add_metric([*values, decision], count)
        yield anomalies
        observer = self.observer
        if observer.snapshot_duration_count:  # only rank 0 times the commits it writes
            histogram = HistogramMetricFamily(
                PREFIX + "snapshot_duration_seconds", "Training blocked by each committed snapshot.", labels=names
            )
            buckets = [(str(bound), n) for bound, n in zip(SNAPSHOT_DURATION_BUCKETS_S, observer.snapshot_buckets)]
            histogram.add_metric(
                values, [*buckets, ("+Inf", observer.snapshot_duration_count)], observer.snapshot_duration_sum_s
            )
            yield histogram
        restarts = CounterMetricFamily(
            PREFIX + "restarts",
            "Worker-group restarts by the launcher (torchrun/SLURM restart count, the group's highest).",
            labels=names,
        )
        restarts.add_metric(values, info.restart_count)
        yield restarts
        goodput = self.observer.goodput
        if goodput is None:
            return
        seconds = CounterMetricFamily(
            PREFIX + "goodput_seconds",
            "Wall-clock seconds by cause, over every attempt of the run.",
            labels=[*names, "cause"],
        )
        for cause, value in goodput.seconds_by_cause().items():
            seconds.add_metric([*values, cause], value)
        yield seconds
        ratio = GaugeMetricFamily(
            PREFIX + "goodput_ratio", "Productive seconds over all seconds counted.", labels=names
        )
        ratio.add_metric(values, goodput.goodput_ratio())
        yield ratio
