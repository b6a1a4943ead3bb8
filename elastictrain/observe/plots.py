"""Loss and metric curves as PNG files, with every restart and world-size change marked on them.

``write_plots(records, attempts, out_dir)`` draws one figure for train and validation loss, one
per other metric (``train_X`` and ``val_X`` together) and one for the learning rate, each
against the optimizer step. ``records`` is a snapshot's metric history, ``attempts`` the list of
attempts (launches and relaunches) that started or restored the run. matplotlib is optional
(``pip install 'elastictrain[plot]'``) and imported only when drawing, with the Agg backend
through the ``Figure`` API, so no pyplot state or display is touched in the caller's process.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastictrain.core.errors import ElastictrainError

SPLIT_PREFIXES = ("train_", "val_")
SPLIT_NAMES = {"train_": "train", "val_": "validation"}
NOT_METRICS = ("step", "epoch")
FIGURE_SIZE_IN = (8.0, 4.5)
DPI = 100
RESTART_COLOR = "tab:red"
WORLD_COLOR = "tab:purple"


class PlotsUnavailable(ElastictrainError):
    """Plots cannot be drawn here (matplotlib is not installed)."""


@dataclass(frozen=True)
class Marker:
    """A vertical line on every plot: the restarts and world-size changes at one step."""

    step: int
    restart_counts: tuple[int, ...] = ()  # the launcher's restart count of each attempt resuming here; 0: a relaunch
    world_sizes: tuple[int, ...] = ()  # the world sizes it went through, e.g. (2, 1); empty: unchanged

    @property
    def label(self) -> str:
        counts = [str(count) for count in self.restart_counts if count > 0]
        relaunches = len(self.restart_counts) - len(counts)
        parts = [f"restart{'s' if len(counts) > 1 else ''} {', '.join(counts)}"] if counts else []
        if relaunches:
            parts.append("relaunch" if relaunches == 1 else f"{relaunches} relaunches")
        text = " + ".join(parts) + f" @ step {self.step}" if parts else f"step {self.step}"
        if self.world_sizes:
            text += ", world " + "\u2192".join(str(size) for size in self.world_sizes)
        return text


def attempt_markers(attempts: list[dict[str, Any]]) -> list[Marker]:
    """The restarts and world-size changes in a run's attempts, one marker per step, in order.

    An attempt is a restart when it resumed from a step above 0, or when the launcher's restart
    count differs from the attempt before (a restart before the first snapshot resumes from 0);
    the first attempt is compared with a count of 0. A restart is labelled with the launcher's
    count (torchrun's ``restart_count``, as its logs say), or "relaunch" where the count went
    back to 0 because the whole job was launched again. Attempts that died before writing a
    snapshot are not in the list; a jump in the count (1 to 3) shows them. Attempts resuming
    from one step share one marker, so their labels do not print over each other.
    """
    markers: list[Marker] = []
    previous_restart_count, previous_world_size = 0, None
    for attempt in attempts:
        step = int(attempt.get("start_step", 0))
        restart_count = int(attempt.get("restart_count", 0))
        world_size = attempt.get("world_size")
        restart: tuple[int, ...] = (restart_count,) if step > 0 or restart_count != previous_restart_count else ()
        world: tuple[int, ...] = ()
        if previous_world_size is not None and world_size is not None and world_size != previous_world_size:
            world = (int(previous_world_size), int(world_size))
        if restart or world:
            if markers and markers[-1].step == step:
                last = markers.pop()
                world = last.world_sizes + world[1:] if last.world_sizes and world else last.world_sizes or world
                restart = last.restart_counts + restart
            markers.append(Marker(step, restart, world))
        previous_restart_count = restart_count
        if world_size is not None:
            previous_world_size = world_size
    return markers


def metric_groups(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Which history keys share a figure: {'loss': ['train_loss', 'val_loss'], ..., 'lr': ['lr']}.

    Loss comes first, the learning rate last, other metrics alphabetically in between.
    """
    groups: dict[str, list[str]] = {}
    for record in records:
        for key, value in record.items():
            if key in NOT_METRICS or not _is_number(value):
                continue
            name = _strip_split(key)
            if key not in groups.setdefault(name, []):
                groups[name].append(key)
    order = sorted(groups, key=lambda name: (name != "loss", name == "lr", name))
    return {name: sorted(groups[name], key=lambda key: (not key.startswith("train_"), key)) for name in order}


def write_plots(
    records: list[dict[str, Any]], attempts: list[dict[str, Any]], out_dir: str | Path, run_name: str | None = None
) -> list[Path]:
    """Draw one PNG per metric group into `out_dir` (created if needed) and return their paths.

    Raises PlotsUnavailable if matplotlib is not installed; draws nothing for empty `records`.
    """
    groups = metric_groups(records)
    if not groups:
        return []
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(
            "plots need matplotlib, which is not installed; pip install 'elastictrain[plot]'"
        ) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markers = attempt_markers(attempts)
    paths = []
    for name, keys in groups.items():
        figure = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
        _draw(figure.add_subplot(), name, keys, records, markers, run_name)
        path = out / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
        figure.savefig(path, format="png")
        paths.append(path)
    return paths


def _draw(axes, name: str, keys: list[str], records, markers: list[Marker], run_name: str | None) -> None:
    title = "learning rate" if name == "lr" else name
    for key in keys:
        points = [(int(r["step"]), float(r[key])) for r in records if _is_number(r.get(key)) and "step" in r]
        steps, values = [p[0] for p in points], [p[1] for p in points]
        is_val = key.startswith("val_")
        split = next((SPLIT_NAMES[p] for p in SPLIT_PREFIXES if key.startswith(p)), None)
        label = f"{split} {title}" if split else title
        axes.plot(
            steps,
            values,
            label=label,
            linewidth=1.8,
            marker="o" if is_val or len(points) < 3 else None,
            markersize=4,
            color="tab:orange" if is_val else "tab:blue",
            # The learning rate is logged every log interval and changes in steps (a schedule's
            # drop): hold each value until the next record instead of drawing a slope between them.
            drawstyle="steps-post" if name == "lr" else "default",
        )
    for index, marker in enumerate(markers):
        color = RESTART_COLOR if marker.restart_counts else WORLD_COLOR
        kind = "restart" if marker.restart_counts else "world size change"
        first_of_kind = all(bool(m.restart_counts) != bool(marker.restart_counts) for m in markers[:index])
        axes.axvline(
            marker.step,
            color=color,
            linestyle="--",
            linewidth=1.2,
            alpha=0.8,
            label=kind if first_of_kind else None,
        )
        # Text along the line, from the top of the axes down, so it never hides the curves' start.
        axes.annotate(
            marker.label,
            xy=(marker.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -4),
            textcoords="offset points",
            rotation=90,
            va="top",
            ha="left",
            fontsize=8,
            color=color,
            bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
        )
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(title)
    axes.set_title(f"{run_name}: {title}" if run_name else title)
    axes.grid(alpha=0.3)
    # Below the axes, in one row: inside them it would hide a curve or a marker's label.
    handles, labels = axes.get_legend_handles_labels()
    axes.figure.legend(handles, labels, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False)


def _strip_split(key: str) -> str:
    for prefix in SPLIT_PREFIXES:
        if key.startswith(prefix) and len(key) > len(prefix):
            return key[len(prefix) :]
    return key


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
