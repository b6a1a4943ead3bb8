"""TensorBoard: event files in one directory (one TensorBoard run), a new file per attempt."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import TYPE_CHECKING, Any

from elastictrain.core.errors import ConfigError
from elastictrain.observe.trackers.ids import TrackingIds

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

RESTART_MARKER = "elastictrain/restart"
CONFIG_TAG, SUMMARY_TAG = "elastictrain/config", "elastictrain/summary"


def stored_steps(directory: str) -> tuple[dict[str, int], set[tuple[int, int, int]]]:
    """The highest step of every tag in the event files of ``directory`` (a torn last record is ignored), and the
    restart markers as (step, attempt, unix time in ms)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    stored: dict[str, int] = {}
    markers: set[tuple[int, int, int]] = set()
    if not os.path.isdir(directory):
        return stored, markers
    for name in sorted(os.listdir(directory)):
        if "tfevents" not in name:
            continue
        for event in EventFileLoader(os.path.join(directory, name)).Load():
            for value in event.summary.value:
                stored[value.tag] = max(stored.get(value.tag, -1), event.step)
                if value.tag == RESTART_MARKER:
                    markers.add((event.step, round(scalar_of(value)), int(event.wall_time * 1000)))
    return stored, markers


def scalar_of(value: Any) -> float:
    """A scalar summary value as the writer stored it: simple_value, or a one-element tensor."""
    if value.HasField("tensor"):
        from tensorboard.util import tensor_util

        return float(tensor_util.make_ndarray(value.tensor).item())
    return float(value.simple_value)


def check_installed() -> None:
    """At start, on the training thread (the import itself happens on the tracker's thread)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "track.tensorboard=true needs the tensorboard package: pip install "
            "'elastictrain[tensorboard]', or set track.tensorboard=false (nothing saved is lost)"
        )


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer_class, self.directory = SummaryWriter, directory
        self.writer: SummaryWriter | None = None  # open() makes it
        self._tags: dict[str, int] = {}
        self._markers: set[tuple[int, int, int]] = set()

    def open(self, ids: TrackingIds, store: Any) -> bool:
        self._tags, self._markers = stored_steps(self.directory)
        # Each attempt appends a file of its own: TensorBoard reads the directory's files as one run.
        self.writer = self._writer_class(log_dir=self.directory)
        return not any(tag.startswith(CONFIG_TAG) for tag in self._tags)

    @property
    def _open_writer(self) -> SummaryWriter:
        assert self.writer is not None, "open() makes the writer"
        return self.writer

    def written(self) -> dict[str, int]:
        return dict(self._tags)

    def write(self, points: list[tuple[str, int, float, float]]) -> None:
        for name, step, value, wall_time_s in points:
            self._open_writer.add_scalar(name, value, step, walltime=wall_time_s)
        self._open_writer.flush()

    def markers(self) -> set[tuple[int, int, int]]:
        return set(self._markers)

    def mark_restart(self, step: int, attempt: int, reason: str, wall_time_s: float) -> None:
        self._open_writer.add_scalar(RESTART_MARKER, attempt, step, walltime=wall_time_s)
        self._open_writer.flush()

    def log_config(self, config: dict[str, Any]) -> None:
        self._open_writer.add_text(CONFIG_TAG, "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        self._open_writer.flush()

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        if any(tag.startswith(SUMMARY_TAG) for tag in self._tags):
            return  # a relaunch of a finished run
        self._open_writer.add_text(SUMMARY_TAG, " ".join(f"{k}={v}" for k, v in summary.items()), step)
        self._open_writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
