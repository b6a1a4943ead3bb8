"""Snapshots written in the background (snapshot.durable.async_write): the same bytes as a blocking
snapshot of the same step, training goes on during the write, and a failed write stops the run
at the next step instead of being lost."""

from __future__ import annotations

import time
from collections import OrderedDict

import pytest
import torch

import elastictrain.snapshot.snapshotter as snapshotter_module
from elastictrain import State, StorageError, Trainer, seed_everything
from elastictrain.core.events import Observer
from elastictrain.snapshot.format import load_object
from elastictrain.snapshot.staging import Stager
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals
from tests.test_trainer import SMALL, config, memory_url


class Reports(Observer):
    def __init__(self) -> None:
        self.reports = []

    def snapshotted(self, report) -> None:
        self.reports.append(report)


def run(url: str, async_write: bool, **snapshot) -> Trainer:
    seed_everything(0)
    cfg = config(url)
    cfg["snapshot"]["durable"].update({"keep_last": 100, "async_write": async_write, **snapshot})
    trainer = Trainer.from_task(spirals.build(**SMALL), cfg)
    trainer.fit()
    return trainer


def snapshot_contents(url: str) -> dict[int, tuple]:
    store = SnapshotStore(url)
    contents = {}
    for listing in store.list_snapshots():
        manifest, objects = store.read_verified(listing.snapshot_id)
        weights = load_object(objects["model.pt"], listing.snapshot_id)
        state = load_object(objects["state.pt"], listing.snapshot_id)
        contents[manifest.step] = (weights, state["optimizer"], state["progress"], state["rng"])
    return contents


def assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_a_background_snapshot_holds_its_own_step_while_training_goes_on(monkeypatch):
    blocking_url = memory_url()
    blocking = run(blocking_url, async_write=False)

    # Slow every background write down, and note the step training had reached when it ended.
    steps_when_written: list[tuple[int, int]] = []
    trainer_ref: list[Trainer] = []
    slow_commit = snapshotter_module.Snapshotter._commit

    def commit(self, step, *args, **kwargs):
        time.sleep(0.3)  # longer than the 10 steps to the next snapshot: it waits for this one
        outcome = slow_commit(self, step, *args, **kwargs)
        steps_when_written.append((step, trainer_ref[0].progress.global_step))
        return outcome

    monkeypatch.setattr(snapshotter_module.Snapshotter, "_commit", commit)
    url = memory_url()
    seed_everything(0)
    cfg = config(url)
    cfg["snapshot"]["durable"].update({"keep_last": 100, "async_write": True})
    reports = Reports()
    background = Trainer.from_task(spirals.build(**SMALL), cfg, observers=[reports])
    trainer_ref.append(background)
    background.fit()

    assert background.summary.params_sha256 == blocking.summary.params_sha256
    expected, written = snapshot_contents(blocking_url), snapshot_contents(url)
    assert sorted(written) == sorted(expected) == list(range(10, 61, 10)) + [64]
    for step in expected:  # the bytes of step N, not of whatever step training reached during the write
        assert_same(written[step], expected[step], f"step {step}")
    assert any(reached > step for step, reached in steps_when_written), "training went on while a snapshot was written"
    # A write the next snapshot had to wait for is reported too, once, in order.
    assert [(r.step, r.committed) for r in reports.reports] == [(step, True) for step in sorted(expected)]
    assert all(r.write_s >= 0.3 for r in reports.reports)


@pytest.mark.slow
@pytest.mark.parametrize("failing_step", [20, 64])  # 64: the final snapshot, waited for before DONE
def test_a_background_write_that_fails_for_good_stops_the_run_at_the_next_step(monkeypatch, failing_step):
    real_commit = SnapshotStore.commit

    def commit(self, step, writers, meta, written=None, recycle=True):
        if step == failing_step:
            raise StorageError(f"snapshot step {step} could not be written: no space left on device")
        return real_commit(self, step, writers, meta, written, recycle)

    monkeypatch.setattr(SnapshotStore, "commit", commit)
    url = memory_url()
    seed_everything(0)
    cfg = config(url)
    cfg["snapshot"]["durable"].update({"async_write": True})
    trainer = Trainer.from_task(spirals.build(**SMALL), cfg)
    entered = []
    trainer.on()(lambda src, dst, step: entered.append(dst))
    with pytest.raises(StorageError, match="no space left on device"):
        trainer.fit()
    assert failing_step <= trainer.progress.global_step < failing_step + 10, "stopped at the first vote after it"
    assert entered[-1] is State.FAILED
    kept = [s.step for s in SnapshotStore(url).list_snapshots()]
    assert kept[-1] == failing_step - (4 if failing_step == 64 else 10), "the committed snapshots are kept"


def test_a_crash_of_the_background_writer_reaches_the_training_thread_with_its_traceback(monkeypatch):
    def broken(obj):
        def write(fileobj):
            raise ZeroDivisionError("a bug in the writer")
        return write

    monkeypatch.setattr(snapshotter_module, "writer_for", broken)
    seed_everything(0)
    cfg = config(memory_url())
    cfg["snapshot"]["durable"].update({"async_write": True})
    trainer = Trainer.from_task(spirals.build(**SMALL), cfg)
    with pytest.raises(ZeroDivisionError, match="a bug in the writer"):
        trainer.fit()
    assert 10 <= trainer.progress.global_step < 20, "stopped before the next snapshot"


def test_staging_reuses_its_buffers_and_shares_nothing_with_the_source():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    stager = Stager()
    tree = {"model": model.state_dict(), "counters": {"step": 1}, "rng": [torch.arange(5)]}
    first = stager.stage(tree)
    pointers = [first["model"]["0.weight"].data_ptr(), first["rng"][0].data_ptr()]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    tree["counters"]["step"] = 2
    assert not torch.equal(first["model"]["0.weight"], model[0].weight), "the staged copy followed the live tensor"
    assert first["counters"]["step"] == 1
    assert isinstance(first["model"], OrderedDict) and first["model"]._metadata == model.state_dict()._metadata

    second = stager.stage({"model": model.state_dict(), "counters": {"step": 2}, "rng": [torch.arange(5)]})
    assert [second["model"]["0.weight"].data_ptr(), second["rng"][0].data_ptr()] == pointers, "buffers reused"
    assert torch.equal(second["model"]["0.weight"], model[0].weight)
    held = stager.nbytes
    stager.stage({"model": model.state_dict(), "counters": {}, "rng": [torch.arange(7)]})  # a shape changed
    assert stager.nbytes == held + 2 * 8
    stager.stage({"rng": [torch.arange(7)]})
    assert stager.nbytes == 7 * 8, "buffers of tensors that are gone are freed"


def test_staging_a_dtensor_keeps_its_layout_and_stages_its_local_shard_in_a_reused_buffer():
    """ShardedState.stage (dist.strategy=fsdp, async_write): the staged shards are DTensors DCP saves as it would
    the live ones, and they no longer follow training."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        live = distribute_tensor(torch.arange(6.0).reshape(3, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
        stager = Stager()
        first = stager.stage({"model": {"w": live}})["model"]["w"]
        assert isinstance(first, DTensor) and first.placements == live.placements and first.shape == live.shape
        live.to_local().add_(1.0)
        assert torch.equal(first.to_local(), torch.arange(6.0).reshape(3, 2)), "the staged copy followed the live one"
        second = stager.stage({"model": {"w": live}})["model"]["w"]
        assert second.to_local().data_ptr() == first.to_local().data_ptr(), "buffer reused"
        assert torch.equal(second.full_tensor(), live.full_tensor())
    finally:
        tdist.destroy_process_group()
