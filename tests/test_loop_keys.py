"""Keys a custom loop applies by asking the session (elastictrain/train/loop_keys.py): session.autocast(),
session.val_loader(); one warning line for a key set and never asked for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elastictrain.train.loop_keys import unused_keys
from elastictrain.train.session import Session
from tests.test_session_api import config, points

DEFAULTS = {"data.val_batch_size": 256, "train.autocast_dtype": "none"}


@pytest.mark.parametrize("values, asked, moment, expected", [
    (DEFAULTS, set(), "restore", []),
    (DEFAULTS, set(), "first step", []),
    ({**DEFAULTS, "data.val_batch_size": 64}, set(), "restore",
     ["data.val_batch_size=64 does nothing in this loop: only session.val_loader() applies it, and this loop did not "
      "call it by its restore; evaluate on session.val_loader(val_set), built before restore() (a Trainer: give it "
      "val_data), or leave the key at "
      "its default (256)"]),
    ({**DEFAULTS, "data.val_batch_size": 64}, {"data.val_batch_size"}, "restore", []),
    ({**DEFAULTS, "data.val_batch_size": 64}, set(), "first step", []),  # said at restore, not again
    ({**DEFAULTS, "train.autocast_dtype": "bfloat16"}, set(), "first step",
     ["train.autocast_dtype=bfloat16 does nothing in this loop: only session.autocast() applies it, and this loop "
      "did not call it by its first step; run the forward and the loss under `with session.autocast():`, or leave "
      "the key at its default (none)"]),
    ({**DEFAULTS, "train.autocast_dtype": "bfloat16"}, {"train.autocast_dtype"}, "first step", []),
])
def test_a_key_set_and_never_asked_for_is_one_line(values, asked, moment, expected):
    assert unused_keys(values, DEFAULTS, asked, moment) == expected


def loop(tmp_path, overrides: dict, *, use_autocast: bool, use_val_loader: bool) -> tuple[list, list]:
    """A custom loop of two steps; returns the logits' dtypes and the validation batch sizes it saw."""
    cfg = config(tmp_path, max_steps=2, **overrides.get("train", {}))
    cfg["data"] = overrides.get("data", {})
    dtypes, val_batches = [], []
    with Session(cfg) as session:
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(points())
        val_loader = session.val_loader(points(20)) if use_val_loader else None
        session.restore()
        for inputs, labels in loader:
            with session.autocast() if use_autocast else torch.enable_grad():
                logits = model(inputs)
                loss = F.cross_entropy(logits.float(), labels)
            dtypes.append(logits.dtype)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(loss=loss)
        val_batches = [len(labels) for _inputs, labels in val_loader] if val_loader is not None else []
    return dtypes, val_batches


def warnings_in(err: str) -> list[str]:
    return [line.split(" WARNING ", 1)[1] for line in err.splitlines() if " WARNING " in line and "does nothing" in line]


def test_a_custom_loop_that_asks_gets_autocast_and_the_validation_batch(tmp_path, capsys):
    set_both = {"train": {"autocast_dtype": "bfloat16"}, "data": {"val_batch_size": 8}}
    dtypes, val_batches = loop(tmp_path, set_both, use_autocast=True, use_val_loader=True)
    assert dtypes == [torch.bfloat16, torch.bfloat16] and val_batches == [8, 8, 4]  # 20 samples, one rank
    assert warnings_in(capsys.readouterr().err) == []


def test_a_custom_loop_that_does_not_ask_is_told_once_per_key(tmp_path, capsys):
    set_both = {"train": {"autocast_dtype": "bfloat16"}, "data": {"val_batch_size": 8}}
    dtypes, _ = loop(tmp_path, set_both, use_autocast=False, use_val_loader=False)
    assert dtypes == [torch.float32, torch.float32]
    said = warnings_in(capsys.readouterr().err)
    assert [line.split(" does nothing")[0] for line in said] == ["data.val_batch_size=8", "train.autocast_dtype=bfloat16"]


@pytest.mark.parametrize("val_data, warned", [(True, []), (False, ["data.val_batch_size=8"])])
def test_the_trainer_asks_for_both_keys_itself(tmp_path, capsys, val_data, warned):
    """The Trainer evaluates on session.val_loader() and steps under session.autocast(): it is warned only when a
    key truly does nothing (a validation batch without a validation set)."""
    from elastictrain import Trainer
    from elastictrain.train.tasks import spirals

    task = spirals.build(train_samples=64, val_samples=32, hidden=8)
    task.val_data = task.val_data if val_data else None
    cfg = config(tmp_path, max_steps=2, autocast_dtype="bfloat16")
    cfg["data"] = {"val_batch_size": 8}
    Trainer.from_task(task, cfg).fit()
    assert [line.split(" does nothing")[0] for line in warnings_in(capsys.readouterr().err)] == warned
