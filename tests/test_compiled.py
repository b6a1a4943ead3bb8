"""A torch.compile'd model: its snapshots hold the plain model's names, and it resumes bitwise.

torch.compile wraps a model in an OptimizedModule whose state_dict keys all start with ``_orig_mod.``. The
registry takes the wrapper off (ddp.state_module), so a compiled run and a plain run read each other's
snapshots; a snapshot saved with the wrapper's names (snapshot.without_compile_wrapper) loads too.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict

import pytest
import torch
from torch import nn

from elastictrain import Trainer, seed_everything
from elastictrain.dist.ddp import state_module
from elastictrain.snapshot.format import load_model_weights, load_object, without_compile_wrapper
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals

W = torch.zeros(1)


@pytest.mark.parametrize("weights, own, expected", [
    ({"0.weight": W}, {"0.weight": W}, ["0.weight"]),  # plain into plain: as is
    ({"_orig_mod.0.weight": W, "_orig_mod.0.bias": W}, {"0.weight": W, "0.bias": W}, ["0.weight", "0.bias"]),
    ({"generator._orig_mod.0.weight": W, "critic.0.weight": W}, {"generator.0.weight": W, "critic.0.weight": W},
     ["generator.0.weight", "critic.0.weight"]),  # several models, one of them compiled
    ({"_orig_mod.0.weight": W}, {"_orig_mod.0.weight": W}, ["_orig_mod.0.weight"]),  # the model has the names itself
    ({"my_orig_mod.weight": W}, {"weight": W}, ["my_orig_mod.weight"]),  # a name that only contains the word
])
def test_the_compile_wrappers_names_are_taken_off_only_where_the_model_has_none(weights, own, expected):
    assert list(without_compile_wrapper(OrderedDict(weights), own)) == expected


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_a_compiled_models_state_dict_loads_into_the_plain_model_and_the_registry_saves_the_plain_one():
    plain, other = mlp(), mlp()
    compiled = torch.compile(other, backend="eager")  # wrapped now, compiled at its first call (none here)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(1.0)
    saved = compiled.state_dict()
    assert all(key.startswith("_orig_mod.") for key in saved)
    load_model_weights(plain, saved, "test")
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), other.state_dict().values()))
    assert state_module(compiled) is other and state_module(plain) is plain


SMALL = {"train_samples": 512, "val_samples": 128, "hidden": 32}


def run(url: str, device: str, backend: str | None, fail_at_call: int | None = None):
    """The spirals task for 2 epochs (64 steps), compiled with ``backend`` (None: not compiled), snapshots every 10."""
    seed_everything(0)
    task = spirals.build(**SMALL)
    if backend is not None:
        task.model = torch.compile(task.model, backend=backend)
    loss_fn, calls = task.loss_fn, [0]

    def failing_loss(model, batch):
        if model.training:
            calls[0] += 1
            if calls[0] == fail_at_call:
                raise RuntimeError(f"a bug at call {fail_at_call}")
        return loss_fn(model, batch)

    task.loss_fn = failing_loss
    return Trainer.from_task(task, {
        "dist": {"device": device},
        "snapshot": {"durable": {"url": url, "every_steps": 10}},
        "train": {"max_epochs": 2, "batch_size": 16, "log_every_steps": 10},
        "log": {"progress_bar": False, "plots": False},
    }).fit()


@pytest.mark.slow
@pytest.mark.parametrize("device, backend", [
    ("cpu", "aot_eager"),  # dynamo's trace and AOTAutograd without code generation: seconds on the CPU
    pytest.param("cuda:0", "inductor", marks=pytest.mark.cuda),  # the default backend, with Triton kernels
])
def test_a_compiled_model_resumes_bitwise_and_a_plain_model_resumes_from_its_snapshot(device, backend):
    unbroken = run(f"memory://compiled/{uuid.uuid4().hex}", device, backend)
    url = f"memory://compiled/{uuid.uuid4().hex}"
    with pytest.raises(RuntimeError, match="a bug at call 25"):
        run(url, device, backend, fail_at_call=25)
    listing, objects = SnapshotStore(url).latest_valid()
    assert listing.step == 20
    assert not [key for key in load_object(objects["model.pt"], "step 20") if "_orig_mod" in key]
    resumed = run(url, device, backend)
    assert resumed.global_step == unbroken.global_step == 64
    assert resumed.params_sha256 == unbroken.params_sha256
    # The compiled run's snapshot of step 60 (the final one removed) into the model uncompiled: it loads, trains on.
    store = SnapshotStore(url)
    store.fs.rm(f"{store.root}/step-{64:012d}", recursive=True)
    plain = run(url, device, None)
    assert plain.global_step == 64 and plain.attempts == 3
