"""benchmarks/gpu_snapshot.py's arithmetic: the model's shape for a size, and which steps count as near a snapshot.

The benchmark itself runs tiny on the CPU in tests/test_benchmark_workers.py; the GPU run is benchmarks/gpu/run_all.sh.
"""

from __future__ import annotations

import pytest

from benchmarks.gpu_snapshot import WARMUP_STEPS, around_snapshots, shape_for


@pytest.mark.parametrize("params, shape", [
    (1e6, (256, 15)),  # the CPU check: 15 x 256^2 = 0.98 M
    (5e8, (8192, 7)),  # run_all.sh's default: 7 x 8192^2 = 0.47 G
    (1e9, (8192, 15)),
    (3e9, (8192, 45)),  # width capped at 8192: more layers
    (1e3, (256, 1)),  # at least one hidden layer
])
def test_the_models_width_and_depth_follow_the_size_asked(params, shape):
    assert shape_for(params) == shape


def test_the_steps_around_each_snapshot_are_compared_with_the_median_of_the_others():
    # A snapshot after step s sits in step time s-1 (forward of step s to forward of s+1); s and s+1 come after it.
    step_times = [9.0] * WARMUP_STEPS + [1.0, 1.0, 1.5, 3.0, 1.2, 1.1, 1.0, 1.0, 1.0, 1.0]
    found = around_snapshots(step_times, [7])  # step times 6 (the snapshot), 7 and 8 (after it)
    assert found["at_snapshot_step_s"] == [3.0]
    assert found["after_snapshot_step_s"] == [1.2, 1.1]
    assert found["baseline_steps"] == 7 and found["baseline_step_s"] == 1.0  # warm-up and times 6-8 left out
    assert found["at_snapshot_slowdown"] == pytest.approx(2.0)
    assert found["after_snapshot_slowdown"] == pytest.approx(0.15)


def test_a_snapshot_after_the_last_step_has_no_step_after_it():
    found = around_snapshots([1.0] * 10, [10, 11])
    assert found["at_snapshot_step_s"] == [1.0] and found["after_snapshot_step_s"] == []
    assert found["after_snapshot_slowdown"] is None
