"""The tracker run ids an elastictrain run keeps in its snapshots (a Stateful of ``RunState``)."""

from __future__ import annotations

from typing import Any

RUN_ID_KEY = "tracking/mlflow_run_id"  # in the launcher's store: for an attempt that died before its first snapshot


class TrackingIds:
    """The tracker run ids of this elastictrain run (MLflow's), saved in every snapshot: one tracker run across
    attempts and relaunches."""

    def __init__(self) -> None:
        self.mlflow_run_id = ""

    def state_dict(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.mlflow_run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mlflow_run_id = state_dict.get("mlflow_run_id", "") or self.mlflow_run_id
