"""May this run resume from that snapshot: its config against the snapshot's, and what changed on the way.

A change of a key in ``RESUME_CRITICAL_KEYS`` (another data order, other data, another model or
another batch geometry inside one run) is refused with one line unless the user accepts it
(``snapshot.accept_changes``); any other change is logged in one line and applied.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from elastictrain.core.config import Config
from elastictrain.core.errors import SnapshotError

log = logging.getLogger("elastictrain")

# Config keys whose change makes a resume wrong: another data order, other data, another model
# or another batch geometry inside one run. Any other change is logged in one line and applied.
RESUME_CRITICAL_KEYS = (
    "run.seed",
    "task.factory",
    "task.args",
    "train.batch_size",
    "train.grad_accum_steps",
    "data.shuffle",
    "train.virtual_shards",
    "train_data.len",
)


def check_config(
    cfg: Config, train_samples: int | None, saved: dict[str, Any], saved_env: dict[str, Any], where: str
) -> None:
    """One line naming every key that changed since the snapshot; refuse the changes that make a resume wrong."""
    changes = config_changes(saved, cfg.to_dict(redact=True))
    if saved_env.get("train_samples") != train_samples and "train_samples" in saved_env:
        changes["train_data.len"] = (saved_env["train_samples"], train_samples)
    if not changes:
        return
    accepted = cfg.snapshot.accept_changes
    critical = [key for key in changes if _under(key, RESUME_CRITICAL_KEYS) and not _under(key, accepted)]
    if critical:
        shown = ", ".join(f"{key}={changes[key][0]!r} (this run: {changes[key][1]!r})" for key in critical)
        raise SnapshotError(
            f"{where} was made with {shown}: resuming would change the data or the batch geometry in the middle "
            f"of the run; {start_fresh_advice(cfg)}, or accept it with "
            f"snapshot.accept_changes=[{','.join(critical)}] — nothing was deleted"
        )
    log.warning(
        "%s was made with another config; resuming with this run's: %s",
        where,
        ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items()),
    )


def start_fresh_advice(cfg: Config) -> str:
    """How to start this run over beside its snapshots: the key that gives it an empty store (snapshot.resume=false
    is refused while the store holds any)."""
    if cfg.snapshot.durable.url:
        return f"start fresh with snapshot.durable.url set to an empty location (it is {cfg.snapshot.durable.url})"
    return f"start fresh with another {'run.dir' if cfg.run.dir else 'run.name'} (snapshots go to {cfg.durable_snapshot_url})"


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, current value)}`` for every leaf that differs (missing reads as None)."""
    old, new = _flatten(saved), _flatten(current)
    return {
        key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)
    }


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[key] = value
    return flat


def _under(key: str, prefixes: Any) -> bool:
    return any(key == prefix or key.startswith(f"{prefix}.") for prefix in prefixes)


def check_optimizer_fits(optimizer: torch.optim.Optimizer, saved: dict[str, Any], where: str, cfg: Config) -> None:
    """Refuse, in one line, an optimizer state that this run's optimizer cannot take: another optimizer class (its
    parameter groups have keys this one lacks and lack keys it has: loading it would fail in the first step with
    ``KeyError: 'momentum'``) or another number of parameter groups.

    Keys only one side has are a torch version's new options (``__setstate__`` gives them their default): accepted.
    """
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    kind = type(optimizer).__name__
    problem = None
    if len(groups) != len(saved_groups):
        problem = f"{len(saved_groups)} parameter group(s), this run's {kind} has {len(groups)}"
    else:
        for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
            ours, theirs = set(group) - {"params", "initial_lr"}, set(saved_group) - {"params", "initial_lr"}
            if ours - theirs and theirs - ours:
                problem = (
                    f"an optimizer with the options {', '.join(sorted(theirs - ours))}"
                    + (f" (group {index})" if index else "")
                    + f", which this run's {kind} does not have (it has {', '.join(sorted(ours - theirs))})"
                )
                break
    if problem is not None:
        raise SnapshotError(
            f"{where} was saved with {problem}: its state cannot be loaded; use the optimizer the "
            f"snapshot was taken with, or {start_fresh_advice(cfg)} (`elastictrain snapshots export` "
            "writes its weights for a new run) — nothing was deleted"
        )


def warn_on_changed_hyperparameters(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], where: str, cfg: Config
) -> None:
    """Loading the optimizer state brings the snapshot's lr, betas, ... back: say so when this run set others."""
    differences = []
    for index, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved.get("param_groups", []))):
        for name, value in group.items():
            if name in ("params", "initial_lr") or name not in saved_group:
                continue
            # A scheduler moves lr; what the user chose is its starting value, in the snapshot and here alike (a
            # rollback restores into an optimizer whose lr the scheduler has moved since).
            before = saved_group.get("initial_lr", saved_group[name]) if name == "lr" else saved_group[name]
            if name == "lr":
                value = group.get("initial_lr", value)
            if _differs(value, before):
                differences.append(f"{name} {before!r} -> {value!r}" + (f" (group {index})" if index else ""))
    if differences:
        log.warning(
            "%s: the optimizer's hyperparameters differ from this run's (%s); the snapshot's values are "
            "restored with its state — %s to train with the new ones",
            where,
            ", ".join(differences),
            start_fresh_advice(cfg),
        )


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b
