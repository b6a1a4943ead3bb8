"""MLflow: one MLflow run per elastictrain run (its id in the snapshot), metrics by ``log_batch``.

Every call runs on the tracker's thread (background.py), which retries a failed one: a request is bounded by
``MLFLOW_HTTP_REQUEST_TIMEOUT`` (10 s unless set) and not retried inside MLflow's client
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` 0 unless set). Metrics carry the time they were measured, so a batch sent again
after a timeout the server had in fact served is stored once (MLflow's SQL store skips an identical metric).
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from typing import Any

from elastictrain.core.errors import ConfigError
from elastictrain.observe.trackers.ids import RUN_ID_KEY, TrackingIds

MAX_METRICS, MAX_PARAMS, MAX_PARAM_CHARS = 1000, 100, 6000  # MLflow's limits per log_batch and per value
RESTART_MARKER = "elastictrain/restart"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return flat


HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
CREATED_BY = "elastictrain.created_by"  # a tag on the run: a create whose answer was lost is found, not made twice


def check_installed(uri: str) -> None:
    """At start, on the training thread (the import itself happens on the tracker's thread)."""
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            f"track.mlflow_uri={uri!r} needs the mlflow package: pip install 'elastictrain[mlflow]', "
            "or set track.mlflow_uri='' (nothing saved is lost)"
        )


class MlflowBackend:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.experiment, self.run_name, self.run_id = uri, experiment, run_name, ""
        self._creator = uuid.uuid4().hex  # without a token from the run's state (a backend used on its own)

    def open(self, ids: TrackingIds, store: Any) -> bool:
        run_id = ids.mlflow_run_id or self._from_store(store, RUN_ID_KEY)
        created = not run_id
        if created:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
            # A create that timed out, or whose attempt died before the id was kept, may have made the run all the same.
            creator = ids.creator or self._creator
            mine = self.client.search_runs([experiment_id], f"tags.`{CREATED_BY}` = '{creator}'", max_results=1)
            if mine:
                run_id, created = mine[0].info.run_id, not mine[0].data.params  # its config, unless that was logged
            else:
                run_id = self.client.create_run(
                    experiment_id, run_name=self.run_name, tags={"elastictrain.run": self.run_name, CREATED_BY: creator}
                ).info.run_id
            if store is not None:
                store.set(RUN_ID_KEY, run_id)
        ids.mlflow_run_id = self.run_id = run_id
        return created

    @staticmethod
    def _from_store(store: Any, key: str) -> str:
        """What an earlier attempt of this torchrun job kept there before it died without a snapshot."""
        if store is None or not store.check([key]):
            return ""
        return store.get(key).decode()

    def written(self) -> dict[str, int]:
        stored = {}
        for name in self.client.get_run(self.run_id).data.metrics:
            steps = [metric.step for metric in self.client.get_metric_history(self.run_id, name)]
            stored[name] = max(steps, default=-1)
        return stored

    def write(self, points: list[tuple[str, int, float, float]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(name, value, int(wall_time_s * 1000), step) for name, step, value, wall_time_s in points]
        for start in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS])

    def markers(self) -> set[tuple[int, int, int]]:
        history = self.client.get_metric_history(self.run_id, RESTART_MARKER)
        return {(metric.step, round(metric.value), metric.timestamp) for metric in history}

    def mark_restart(self, step: int, attempt: int, reason: str, wall_time_s: float) -> None:
        self.client.log_metric(self.run_id, RESTART_MARKER, attempt, timestamp=int(wall_time_s * 1000), step=step)
        self.client.set_tag(self.run_id, f"elastictrain.attempt.{attempt}", f"{reason} at step {step}")

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, value[:MAX_PARAM_CHARS]) for key, value in flatten(config).items()]
        for start in range(0, len(params), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS])

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(f"summary.{k}", str(v)) for k, v in summary.items()])
        self.client.set_terminated(self.run_id, "FINISHED")

    def close(self) -> None:
        pass
