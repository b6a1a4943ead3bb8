"""Read what the trackers stored back with TensorBoard's own reader (tests of exactly-once tracking)."""

from __future__ import annotations

import os
from pathlib import Path


def tensorboard_points(directory: Path) -> list[tuple[str, int, float]]:
    """Every scalar point in the directory's event files, in file order (duplicates kept: no purge)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    points = []
    for name in sorted(os.listdir(directory)):
        for event in EventFileLoader(str(directory / name)).Load():
            # The loader hands scalars over as float32 tensors of the scalars plugin.
            points += [(value.tag, event.step, value.tensor.float_val[0]) for value in event.summary.value
                       if value.metadata.plugin_data.plugin_name == "scalars"]
    return points


def series_of(points: list[tuple[str, int, float]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in points:
        series.setdefault(name, []).append((step, value))
    return {name: sorted(values) for name, values in series.items()}


def once_each(series: dict[str, list[tuple[int, float]]]) -> None:
    for name, points in series.items():
        steps = [step for step, _ in points]
        assert len(steps) == len(set(steps)), f"{name}: a step written twice: {steps}"
