"""Logs a person and a machine can read: rank and attempt on every line, milliseconds, throughput, JSON lines."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from elastictrain import Trainer, seed_everything
from elastictrain.train.tasks import spirals


@pytest.mark.slow
def test_lines_carry_rank_attempt_milliseconds_and_throughput_and_rank0_writes_json_lines(tmp_path, capfd):
    seed_everything(0)
    Trainer.from_task(spirals.build(train_samples=512, val_samples=128, hidden=16), {
        "run": {"dir": str(tmp_path / "run")},
        "snapshot": {"durable": {"url": f"memory://logs/{uuid.uuid4().hex}", "every_steps": 10}},
        "train": {"max_epochs": 1, "batch_size": 16, "log_every_steps": 8},
        "log": {"progress_bar": False, "plots": False, "jsonl": True},
    }).fit()
    err = capfd.readouterr().err
    interval = [line for line in err.splitlines() if " INFO step 16 epoch 0 " in line]
    assert len(interval) == 1 and re.match(r"\d\d:\d\d:\d\d\.\d{3} \[elastictrain r0 a0\] INFO step 16 epoch 0 ", interval[0])
    assert re.search(r"samples/s=\d+", interval[0])

    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    trains = [r for r in records if r.get("event") == "train"]
    # Every log interval and no other step: a snapshot between two log steps (every 10) does not cut one (its metric
    # values are saved with it instead, so a restart logs what an unbroken run does; its pause is left out of samples/s).
    assert [r["step"] for r in trains] == [8, 16, 24, 32]
    assert all(isinstance(r["train_loss"], float) and r["samples_per_s"] > 0 and r["rank"] == 0 and r["restart"] == 0
               for r in trains)
    assert any(r["message"].startswith("run summary: state=DONE step=32") for r in records)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", records[0]["time"])
