"""State a custom loop forgot to register is named at RESTORE (elastictrain/train/registry_checks.py): pure, by table."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from elastictrain.train.registry_checks import live_optimizers_and_schedulers, unregistered_state, unregistered_state_named
from elastictrain.train.task import PendingScheduler


def gan() -> dict:
    generator, discriminator = nn.Linear(4, 2), nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.Adam(generator.parameters()), torch.optim.Adam(discriminator.parameters())
    ema = copy.deepcopy(generator).requires_grad_(False)
    return {"generator": generator, "discriminator": discriminator, "ema": ema, "opt_g": opt_g, "opt_d": opt_d,
            "scheduler": torch.optim.lr_scheduler.StepLR(opt_g, step_size=5), "scaler": None}


def without(objects: dict, *names: str) -> dict:
    return {name: value for name, value in objects.items() if name not in names}


def test_everything_registered_says_nothing():
    objects = gan()
    assert unregistered_state(objects, list(objects.values())) == []


@pytest.mark.parametrize("left_out, expected", [
    (("opt_d",), ["model 'discriminator': 2 of its 2 trainable parameters are in no registered optimizer (an "
                  "unregistered Adam holds them); session.register() the optimizer that trains them"]),
    (("opt_g", "scheduler"), ["model 'generator': 2 of its 2 trainable parameters are in no registered optimizer (an "
                              "unregistered Adam holds them)"]),
    (("scheduler",), ["optimizer 'opt_g' is driven by a StepLR that is not registered; "
                      "session.register(lr_scheduler=...) it before restore()"]),
])
def test_each_piece_left_out_is_one_line_naming_it(left_out, expected):
    objects = gan()
    found = unregistered_state(without(objects, *left_out), list(objects.values()))
    assert len(found) == len(expected) and all(line.startswith(start) for line, start in zip(found, expected)), found
    assert all("\n" not in line for line in found)


def test_without_the_live_objects_it_still_says_what_is_missing():
    objects = gan()
    assert unregistered_state(without(objects, "scheduler")) == [
        "optimizer 'opt_g' is driven by an LR scheduler (its parameter groups hold initial_lr) that is not registered; "
        "session.register(lr_scheduler=...) it before restore(), or a resume restarts the schedule from its first step"]
    assert unregistered_state(without(objects, "opt_d"))[0].startswith(
        "model 'discriminator': 2 of its 2 trainable parameters are in no registered optimizer; ")


def test_an_ema_that_trains_is_named_frozen_parts_and_factories_are_not():
    objects = gan()
    objects["ema"].requires_grad_(True)
    assert [line.split(":")[0] for line in unregistered_state(objects)] == ["model 'ema'"]
    objects["ema"].requires_grad_(False)
    objects["generator"].bias.requires_grad_(False)  # frozen: nothing to train, nothing lost
    objects["opt_g"] = torch.optim.SGD([objects["generator"].weight], lr=0.1)
    objects["scheduler"] = PendingScheduler(lambda opt, steps: None, objects["opt_g"])  # the Trainer's factory
    assert unregistered_state(objects) == []
    objects["ema"] = torch.optim.swa_utils.AveragedModel(objects["generator"])  # trainable parameters, an average
    assert unregistered_state(objects) == []


def test_the_live_objects_are_found_in_the_process():
    objects = gan()
    live = live_optimizers_and_schedulers()
    assert all(any(o is objects[name] for o in live) for name in ("opt_g", "opt_d", "scheduler"))
    assert unregistered_state_named(without(objects, "scheduler"))[0].startswith(
        "optimizer 'opt_g' is driven by a StepLR that is not registered")
