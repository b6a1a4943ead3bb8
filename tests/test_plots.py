"""plots.write_plots: which restarts are marked (a table), which metrics share a figure, real PNG files."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from elastictrain.observe.plots import Marker, attempt_markers, metric_groups, write_plots

A = dict  # one attempt, as a snapshot records it


@pytest.mark.parametrize(
    "attempts, labels",
    [
        ([], []),
        ([A(restart_count=0, world_size=2, start_step=0)], []),
        ([A(restart_count=0, world_size=2, start_step=0), A(restart_count=1, world_size=2, start_step=300)],
         ["restart 1 @ step 300"]),
        # killed before the first snapshot: the restart resumes from 0, its count tells
        ([A(restart_count=0, world_size=2, start_step=0), A(restart_count=1, world_size=2, start_step=0)],
         ["restart 1 @ step 0"]),
        ([A(restart_count=0, world_size=2, start_step=0), A(restart_count=1, world_size=1, start_step=450)],
         ["restart 1 @ step 450, world 2\u21921"]),
        # an attempt that died before its first snapshot is missing; the jump 0 -> 2 says so
        ([A(restart_count=0, world_size=2, start_step=0), A(restart_count=2, world_size=2, start_step=450)],
         ["restart 2 @ step 450"]),
        # the whole job launched again: the launcher counts from 0
        ([A(restart_count=0, world_size=2, start_step=0), A(restart_count=0, world_size=2, start_step=800)],
         ["relaunch @ step 800"]),
        # two restarts from one snapshot share one marker
        ([A(restart_count=0, world_size=2, start_step=0), A(restart_count=1, world_size=2, start_step=300),
          A(restart_count=2, world_size=1, start_step=300), A(restart_count=3, world_size=2, start_step=500)],
         ["restarts 1, 2 @ step 300, world 2\u21921", "restart 3 @ step 500, world 1\u21922"]),
        # older snapshots' attempts may lack fields: no crash, no invented marker
        ([A(start_step=0), A(start_step=0)], []),
    ],
)
def test_attempt_markers(attempts, labels):
    assert [marker.label for marker in attempt_markers(attempts)] == labels


def test_a_marker_that_only_changes_the_world_size():
    assert Marker(step=40, world_sizes=(2, 1)).label == "step 40, world 2\u21921"


def test_metric_groups_pair_train_and_val_and_put_loss_first_and_lr_last():
    records = [
        {"step": 25, "epoch": 0, "train_loss": 1.0, "train_accuracy": 0.5, "lr": 1e-3, "note": "text"},
        {"step": 50, "epoch": 0, "val_loss": 0.9, "val_accuracy": 0.6, "val_f1": 0.4, "grad_norm": 2.0},
    ]
    assert metric_groups(records) == {
        "loss": ["train_loss", "val_loss"],
        "accuracy": ["train_accuracy", "val_accuracy"],
        "f1": ["val_f1"],
        "grad_norm": ["grad_norm"],
        "lr": ["lr"],
    }


def history(steps: int = 400) -> list[dict]:
    records = []
    for step in range(25, steps + 1, 25):
        records.append({"step": step, "epoch": step // 100, "train_loss": math.exp(-step / 200),
                        "train_accuracy": 1 - 0.5 * math.exp(-step / 200), "lr": 1e-3 * (1 - step / steps)})
        if step % 100 == 0:
            records.append({"step": step, "epoch": step // 100, "val_loss": math.exp(-step / 200) + 0.05,
                            "val_accuracy": 1 - 0.5 * math.exp(-step / 200) - 0.02})
    return records


def red_pixels(path) -> int:
    """Pixels of the restart colour (matplotlib's tab:red, #d62728) in a PNG."""
    from matplotlib.image import imread

    pixels = imread(path)[..., :3]
    red = (pixels[..., 0] > 0.75) & (pixels[..., 1] < 0.3) & (pixels[..., 2] < 0.3)
    return int(red.sum())


@pytest.mark.slow
def test_write_plots_draws_one_png_per_metric_with_the_restart_marked(tmp_path):
    attempts = [A(restart_count=0, world_size=2, start_step=0), A(restart_count=1, world_size=1, start_step=200)]
    paths = write_plots(history(), attempts, tmp_path / "plots", run_name="demo")
    assert [path.name for path in paths] == ["loss.png", "accuracy.png", "lr.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5_000
        assert red_pixels(path) > 100, path  # the dashed line, its label and legend entry

    unmarked = write_plots(history(), attempts[:1], tmp_path / "unmarked")
    assert all(red_pixels(path) == 0 for path in unmarked)


def test_write_plots_with_no_history_draws_nothing(tmp_path):
    assert write_plots([], [], tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


@pytest.mark.slow
def test_without_matplotlib_write_plots_raises_one_clear_error(tmp_path):
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"  # what a missing package looks like to import
        "from elastictrain.observe.plots import PlotsUnavailable, write_plots\n"
        "try:\n"
        f"    write_plots([{{'step': 1, 'train_loss': 1.0}}], [], {str(tmp_path)!r})\n"
        "except PlotsUnavailable as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "plots need matplotlib, which is not installed; pip install 'elastictrain[plot]'"


def test_the_learning_rate_is_drawn_as_steps_and_losses_as_lines():
    """An LR logged every 25 steps that drops 10x at step 60 must not be drawn as a slope from 50 to 75."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from elastictrain.observe.plots import _draw

    records = [{"step": step, "lr": 0.1 if step < 60 else 0.01, "train_loss": 1.0 / step} for step in (25, 50, 75, 100)]
    drawn = {}
    for name, keys in metric_groups(records).items():
        axes = Figure().add_subplot()
        _draw(axes, name, keys, records, [], None)
        drawn[name] = axes.lines[0]
    assert drawn["lr"].get_drawstyle() == "steps-post"
    assert drawn["loss"].get_drawstyle() == "default"
    assert list(drawn["lr"].get_ydata()) == [0.1, 0.1, 0.01, 0.01]
