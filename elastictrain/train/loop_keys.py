"""Config keys a training loop applies by asking the session for them, and the line for a key set but never asked for.

``train.autocast_dtype`` is applied by ``session.autocast()``, ``data.val_batch_size`` by
``session.val_loader()``. The Trainer asks for both; a custom loop that sets one and never asks
would train exactly as without it, so it is told in one warning line: the validation batch at
RESTORE (the validation loader is built in SETUP), autocast at the attempt's first step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from elastictrain.data.sampling import EvalBatchSampler, make_loader, samples_in

# key -> (what applies it, where a loop must have asked by: "restore" or "first step")
ASKED_THROUGH = {
    "data.val_batch_size": ("session.val_loader()", "restore"),
    "train.autocast_dtype": ("session.autocast()", "first step"),
}
_HOW = {
    "data.val_batch_size": "evaluate on session.val_loader(val_set), built before restore() (a Trainer: give it val_data)",
    "train.autocast_dtype": "run the forward and the loss under `with session.autocast():`",
}


def unused_keys(values: dict[str, Any], defaults: dict[str, Any], asked: set[str], moment: str) -> list[str]:
    """One warning line per key of ASKED_THROUGH checked at ``moment`` whose value is not its default
    and that the loop did not ask for."""
    lines = []
    for key, (through, when) in ASKED_THROUGH.items():
        if when != moment or key in asked or values[key] == defaults[key]:
            continue
        lines.append(
            f"{key}={values[key]} does nothing in this loop: only {through} applies it, and this loop did "
            f"not call it by its {moment}; {_HOW[key]}, or leave the key at its default ({defaults[key]})"
        )
    return lines


class LoopKeys:
    """What the loop asked the session for, and the warnings for the keys it did not."""

    def __init__(self, cfg: Any) -> None:
        self.values, self.defaults = _values(cfg), _values(type(cfg)())  # a key given at its default changes nothing
        self.asked: set[str] = set()
        self._stepped = False

    def ask(self, key: str) -> None:
        self.asked.add(key)

    def at_restore(self) -> list[str]:
        return unused_keys(self.values, self.defaults, self.asked, "restore")

    def at_step(self) -> list[str]:
        """The first step's warnings, once; nothing after."""
        if self._stepped:
            return []
        self._stepped = True
        return unused_keys(self.values, self.defaults, self.asked, "first step")


def _values(cfg: Any) -> dict[str, Any]:
    return {"data.val_batch_size": cfg.data.val_batch_size, "train.autocast_dtype": cfg.train.autocast_dtype}


def validation_loader(
    dataset: Dataset, collate_fn: Callable | None, rank: int, world_size: int, cfg: Any
) -> DataLoader:
    """This rank's share of ``dataset`` (every sample once over all ranks) in batches of ``data.val_batch_size``."""
    sampler = EvalBatchSampler(samples_in(dataset), rank, world_size, cfg.data.val_batch_size)
    return make_loader(dataset, sampler, cfg.data.num_workers, cfg.run.seed, collate_fn, seed_in_process=False)
