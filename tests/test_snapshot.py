"""Snapshot contents: RNG round trips, safe loading, clear errors for a different model, the fingerprint."""

from __future__ import annotations

import io
import os
import random
import threading
import zipfile

import numpy as np
import pytest
import torch

from elastictrain.core.errors import SnapshotError
from elastictrain.core.rng import capture_rng, restore_rng
from elastictrain.core.progress import History, Progress
from elastictrain.snapshot.format import load_model_weights, load_object, params_sha256, save_object


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_states_survive_save_and_safe_load():
    buffer = io.BytesIO()
    torch.save({"rng": capture_rng(torch.device("cpu"))}, buffer)
    expected = draws()
    restore_rng(load_object(buffer.getvalue(), "test")["rng"], torch.device("cpu"))
    assert draws() == expected


def draws_on(device: torch.device) -> list:
    """A draw of every RNG a rank uses: python, numpy, torch's CPU generator and, on CUDA, the device's (dropout)."""
    values = [random.random(), float(np.random.rand()), torch.rand(3).tolist()]
    if device.type == "cuda":
        values += [torch.rand(3, device=device).tolist(),
                   torch.nn.functional.dropout(torch.ones(64, device=device), 0.5).tolist()]
    return values


def scramble_rngs(device: torch.device) -> None:
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(14)


@pytest.mark.parametrize("device, map_location", [
    ("cpu", "cpu"), ("cpu", "the device"),
    pytest.param("cuda:0", "cpu", marks=pytest.mark.cuda), pytest.param("cuda:0", "the device", marks=pytest.mark.cuda),
])
def test_rng_states_come_back_onto_the_run_device_whatever_map_location(device, map_location):
    """capture_rng -> save -> load_object(map_location) -> restore_rng: every RNG stream continues where it was.

    restore.py loads the state object onto the run's device (the optimizer's tensors belong there), so on CUDA the
    RNG state tensors arrive on the GPU: each is brought back to the CPU before torch or numpy take it (the bug one
    H200 run found: every CUDA resume failed in RESTORE)."""
    device = torch.device(device)
    location = device if map_location == "the device" else map_location
    buffer = io.BytesIO()
    save_object({"rng": capture_rng(device)}, buffer)
    expected = draws_on(device)
    scramble_rngs(device)
    loaded = load_object(buffer.getvalue(), "test", map_location=location)["rng"]
    assert loaded["torch"].device == torch.device(location)  # where map_location put it, before restore_rng
    restore_rng(loaded, device)
    assert draws_on(device) == expected


def test_save_object_skips_the_zip_crc32_loads_the_same_and_leaves_torchs_setting_alone():
    state = {"weights": torch.randn(64, 64), "step": 7, "nested": [torch.arange(5)]}
    buffer = io.BytesIO()
    save_object(state, buffer)
    # The zip records carry no CRC-32 (the store's checksum covers every byte; torch.load never checks it) ...
    assert {info.CRC for info in zipfile.ZipFile(io.BytesIO(buffer.getvalue())).infolist()} == {0}
    loaded = load_object(buffer.getvalue(), "test")
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 7
    assert torch.equal(loaded["nested"][0], torch.arange(5))
    # ... and a torch.save of the user's afterwards computes it as before, even after a save that failed.
    with pytest.raises(TypeError, match="cannot pickle"):
        save_object({"not picklable": threading.Lock()}, io.BytesIO())
    assert torch.serialization.get_crc32_options() is True
    plain = io.BytesIO()
    torch.save(state, plain)
    assert 0 not in {info.CRC for info in zipfile.ZipFile(io.BytesIO(plain.getvalue())).infolist()}


def test_progress_and_history_round_trip():
    progress, history = Progress(), History()
    progress.advance(64)
    progress.end_epoch()
    history.append(step=1, train_loss=0.5)
    restored_progress, restored_history = Progress(), History()
    restored_progress.load_state_dict(progress.state_dict())
    restored_history.load_state_dict(history.state_dict())
    assert restored_progress == progress and restored_history.records == [{"step": 1, "train_loss": 0.5}]


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-snapshot",))


def test_a_crafted_pickle_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buffer = io.BytesIO()
    torch.save({"model": Exploit()}, buffer)
    with pytest.raises(SnapshotError, match="cannot be loaded safely .*posix.system|cannot be loaded safely .*system"):
        load_object(buffer.getvalue(), "snapshot memory://x/step-1")
    assert not (tmp_path / "pwned-by-snapshot").exists()


def test_garbage_bytes_are_a_snapshot_error():
    with pytest.raises(SnapshotError, match="memory://x"):
        load_object(b"not a torch file", "memory://x")


def test_a_different_model_is_named_precisely():
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 3))
    other = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Linear(5, 3), torch.nn.ReLU())
    weights = other.state_dict()
    weights["9.extra"] = torch.zeros(1)
    with pytest.raises(SnapshotError) as caught:
        load_model_weights(model, weights, "snapshot s3://b/run/step-000000000100")
    message = str(caught.value)
    assert "s3://b/run/step-000000000100 was saved from a different model" in message
    assert "unexpected: 9.extra" in message and "0.weight (5, 2) vs (4, 2)" in message
    # snapshot.resume=false would be refused beside these snapshots: the advice names the key that works.
    assert "snapshot.resume=false" not in message and "start fresh with snapshot.durable.url set to an empty location" in message


def test_params_sha256_sees_one_changed_bit_and_ignores_nothing_else():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = params_sha256(model)
    assert params_sha256(model) == before
    clone = torch.nn.Linear(3, 2)
    clone.load_state_dict(model.state_dict())
    assert params_sha256(clone) == before
    with torch.no_grad():
        bits = model.weight.view(torch.int32)
        bits[0, 0] ^= 1  # flip the lowest mantissa bit of one weight
    assert params_sha256(model) != before
