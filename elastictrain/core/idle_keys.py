"""Config keys that do nothing because another key is unset or off, and the one warning that says so.

``snapshot.local.every_steps=20`` without ``snapshot.local.url`` trains exactly as without it: the
fast tier it paces is off. Each row of ``REQUIRES`` is (key, the key it needs, whether that key's
value turns it on); a key set to other than its default whose requirement is off is named, with
the key to set, in one warning line at restore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_LOCAL_TIER = ("every_steps", "every_s", "mtbf_prior_s", "keep_last", "async_write", "survivor_copies")

# key -> (the key it needs, is that key's value on, what setting it means)
REQUIRES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    **{
        f"snapshot.local.{key}": (
            "snapshot.local.url",
            bool,
            "the fast tier is off; set it to a node-local path such as /dev/shm",
        )
        for key in _LOCAL_TIER
    },
    "snapshot.local.mtbf_prior_s": ("snapshot.local.every_s", lambda v: v == "auto", "set it to auto"),
    "metrics.host": ("metrics.port", lambda v: v > 0, "the exporter is off; set a port"),
    "metrics.per_node": ("metrics.port", lambda v: v > 0, "the exporter is off; set a port"),
    "track.tensorboard_dir": ("track.tensorboard", bool, "set it to true"),
    "stragglers.min_excess_s": ("stragglers.factor", lambda v: v > 0, "set a factor"),
    "stragglers.repeat_after_s": ("stragglers.factor", lambda v: v > 0, "set a factor"),
    "anomaly.warmup_steps": ("anomaly.spike_factor", lambda v: v > 0, "spikes are not judged; set a factor"),
    "anomaly.spike_window_steps": ("anomaly.spike_factor", lambda v: v > 0, "spikes are not judged; set a factor"),
    "anomaly.max_rollbacks": ("anomaly.policy", lambda v: v == "rollback", "set it to rollback"),
}


def idle_keys(values: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """``values``, ``defaults``: flat ``{dotted key: value}``. The keys of REQUIRES set to other than their default
    whose requirement is off, each as ``key=value (needs: ...)``."""
    idle = []
    for key, (needs, on, how) in REQUIRES.items():
        if values[key] != defaults[key] and not on(values[needs]):
            idle.append(f"{key}={values[key]} (needs {needs}: {how})")
    return idle


def idle_keys_line(cfg: Any) -> list[str]:
    """The one warning line for ``cfg`` (a Config), or none."""
    idle = idle_keys(flat_values(cfg), flat_values(type(cfg)()))
    return [f"these keys do nothing as set: {'; '.join(idle)}"] if idle else []


def flat_values(cfg: Any) -> dict[str, Any]:
    """The value of every key REQUIRES names, by its dotted name."""
    keys = set(REQUIRES) | {needs for needs, _, _ in REQUIRES.values()}
    return {key: _get(cfg, key) for key in keys}


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg
