"""Keys that do nothing because another is unset: the table, and the one warning line a run gets."""

from __future__ import annotations

import pytest

from elastictrain.core.config_load import load_config
from elastictrain.core.idle_keys import REQUIRES, flat_values, idle_keys, idle_keys_line


@pytest.mark.parametrize("overrides, idle", [
    ([], []),
    (["snapshot.local.every_steps=20"],
     ["snapshot.local.every_steps=20 (needs snapshot.local.url: the fast tier is off; set it to a node-local path "
      "such as /dev/shm)"]),
    (["snapshot.local.every_steps=20", "snapshot.local.url=/dev/shm/x"], []),
    (["snapshot.local.survivor_copies=false"],
     ["snapshot.local.survivor_copies=False (needs snapshot.local.url: the fast tier is off; set it to a node-local "
      "path such as /dev/shm)"]),
    (["snapshot.local.url=/dev/shm/x", "snapshot.local.mtbf_prior_s=60"],
     ["snapshot.local.mtbf_prior_s=60.0 (needs snapshot.local.every_s: set it to auto)"]),
    (["snapshot.local.url=/dev/shm/x", "snapshot.local.mtbf_prior_s=60", "snapshot.local.every_s=auto"], []),
    (["metrics.per_node=true"], ["metrics.per_node=True (needs metrics.port: the exporter is off; set a port)"]),
    (["metrics.per_node=true", "metrics.port=9100"], []),
    (["track.tensorboard_dir=/tmp/tb"], ["track.tensorboard_dir=/tmp/tb (needs track.tensorboard: set it to true)"]),
    (["stragglers.factor=0", "stragglers.min_excess_s=1"],
     ["stragglers.min_excess_s=1.0 (needs stragglers.factor: set a factor)"]),
    (["anomaly.warmup_steps=5"],
     ["anomaly.warmup_steps=5 (needs anomaly.spike_factor: spikes are not judged; set a factor)"]),
    (["anomaly.warmup_steps=5", "anomaly.spike_factor=3"], []),
    (["anomaly.policy=skip", "anomaly.max_rollbacks=9"],
     ["anomaly.max_rollbacks=9 (needs anomaly.policy: set it to rollback)"]),
    (["snapshot.local.every_steps=0"], []),  # given at its default: it changes nothing, and nothing is said
])
def test_a_key_that_does_nothing_because_another_is_unset_is_named_with_the_one_to_set(overrides, idle):
    cfg = load_config(None, overrides)
    assert idle_keys(flat_values(cfg), flat_values(type(cfg)())) == idle


def test_every_row_names_keys_the_config_has():
    cfg = load_config()
    values = flat_values(cfg)  # a key missing from Config raises AttributeError here
    assert set(REQUIRES) <= set(values)


def test_the_warning_is_one_line_for_all_of_them():
    cfg = load_config(None, ["snapshot.local.every_steps=20", "track.tensorboard_dir=/tmp/tb"])
    assert idle_keys_line(cfg) == [
        "these keys do nothing as set: snapshot.local.every_steps=20 (needs snapshot.local.url: the fast tier is off; "
        "set it to a node-local path such as /dev/shm); track.tensorboard_dir=/tmp/tb (needs track.tensorboard: set "
        "it to true)"]
    assert idle_keys_line(load_config()) == []
