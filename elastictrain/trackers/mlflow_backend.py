"""MLflow: one MLflow run per elastictrain run (its id in the snapshot), metrics by ``log_batch``."""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import ConfigError
from .ids import RUN_ID_KEY, TrackingIds

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


class MlflowBackend:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(f"track.mlflow_uri={uri!r} needs the mlflow package: pip install 'elastictrain[mlflow]', "
                              "or set track.mlflow_uri='' (nothing saved is lost)") from None
        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.experiment, self.run_name, self.run_id = uri, experiment, run_name, ""

    def open(self, ids: TrackingIds, store: Any) -> bool:
        run_id = ids.mlflow_run_id or self._from_store(store)
        created = not run_id
        if created:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
            run_id = self.client.create_run(experiment_id, run_name=self.run_name,
                                            tags={"elastictrain.run": self.run_name}).info.run_id
            if store is not None:
                store.set(RUN_ID_KEY, run_id)
        ids.mlflow_run_id = self.run_id = run_id
        return created

    @staticmethod
    def _from_store(store: Any) -> str:
        """The run an earlier attempt of this torchrun job created before it died without a snapshot."""
        if store is None or not store.check([RUN_ID_KEY]):
            return ""
        return store.get(RUN_ID_KEY).decode()

    def written(self) -> dict[str, int]:
        stored = {}
        for name in self.client.get_run(self.run_id).data.metrics:
            steps = [metric.step for metric in self.client.get_metric_history(self.run_id, name)]
            stored[name] = max(steps, default=-1)
        return stored

    def write(self, points: list[tuple[str, int, float]]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(name, value, now_ms, step) for name, step, value in points]
        for start in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + MAX_METRICS])

    def mark_restart(self, step: int, attempt: int, reason: str) -> None:
        self.client.log_metric(self.run_id, RESTART_MARKER, attempt, step=step)
        self.client.set_tag(self.run_id, f"elastictrain.attempt.{attempt}", f"{reason} at step {step}")

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, value[:MAX_PARAM_CHARS]) for key, value in flatten(config).items()]
        for start in range(0, len(params), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[start:start + MAX_PARAMS])

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(f"summary.{k}", str(v)) for k, v in summary.items()])
        self.client.set_terminated(self.run_id, "FINISHED")

    def close(self) -> None:
        pass
