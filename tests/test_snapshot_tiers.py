"""Two snapshot tiers: each node's fast copies (snapshot.local.url) and the durable store.

A restart restores the newest snapshot any tier holds and verifies; exactness is unchanged; the
fast tier is refused before its first write when it does not fit, and cleaned at DONE."""

from __future__ import annotations

import re
from collections import namedtuple

from types import SimpleNamespace

import pytest

from elastictrain import ConfigError, Trainer, seed_everything
from elastictrain.snapshot.cadence import COST_KEY
from elastictrain.storage.snapshot_store import SnapshotStore
from tests.helpers.corrupt import flip_middle_byte
from tests.helpers.tasks import build
from tests.test_trainer import memory_url

LOCAL_EVERY = 4


def trainer(tmp_path, durable: str, max_steps: int | None = None, local: dict | None = None, observers=(),
            **durable_settings) -> Trainer:
    seed_everything(0)
    task = build(str(tmp_path), raise_rank=0, raise_at_step=durable_settings.pop("raise_at", -1), train_samples=512, hidden=32)
    return Trainer.from_task(task, {
        "snapshot": {"durable": {"url": durable, "every_steps": 10, **durable_settings},
                     "local": {"url": str(tmp_path / "shm"), "every_steps": LOCAL_EVERY, **(local or {})}},
        "train": {"max_epochs": 2, "max_steps": max_steps, "batch_size": 16, "log_every_steps": 5},
        "log": {"progress_bar": False},
    }, observers=observers)


def fast_dir(tmp_path, run_name: str = "default"):
    """The node-local directory of the one run that used ``run_name`` here (``<snapshot.local.url>/<run.name>/<run id>``)."""
    (run_dir,) = (tmp_path / "shm" / run_name).iterdir()
    return run_dir


def local_steps(tmp_path, run_name: str = "default") -> list[int]:
    return [s.step for s in SnapshotStore(str(fast_dir(tmp_path, run_name))).list_snapshots() if s.manifest is not None]


def corrupt(tmp_path, step: int) -> None:
    flip_middle_byte(fast_dir(tmp_path) / f"step-{step:012d}" / "model.pt")


@pytest.mark.slow
def test_a_restart_restores_the_newest_tier_and_ends_bitwise_equal(tmp_path, capfd):
    (tmp_path / "ref").mkdir()
    reference = trainer(tmp_path / "ref", memory_url(), local={"url": None}).fit()

    durable = memory_url()
    crashed = trainer(tmp_path, durable, raise_at=27)
    with pytest.raises(ValueError, match="a bug in the user"):
        crashed.fit()
    # Fast copies at 4, 8, 10 (with the durable one), 12, ... 24; the newest 2 kept.
    assert local_steps(tmp_path) == [20, 24]
    assert [s.step for s in SnapshotStore(durable).list_snapshots()] == [10, 20]
    capfd.readouterr()

    # The newest fast copy is corrupt: the next one in the tier, still newer than the durable 20.
    corrupt(tmp_path, 24)
    resumed = trainer(tmp_path, durable)
    summary = resumed.fit()
    err = capfd.readouterr().err
    assert "restored step 20 from the node-local tier of node 0 (rank 0)" in err, err[-3000:]
    assert summary.params_sha256 == reference.params_sha256
    assert not (tmp_path / "shm").exists(), "the fast tier is cleaned at DONE, the emptied snapshot.local.url too"


@pytest.mark.slow
def test_a_restarted_attempt_times_its_fast_copies_from_the_cost_the_attempt_before_measured(tmp_path, capfd):
    """snapshot.local.every_s=auto: the copy cost rank 0 measured travels in the attempt's record (cadence.COST_KEY)."""
    durable, auto = memory_url(), {"every_s": "auto"}
    with pytest.raises(ValueError, match="a bug in the user"):
        trainer(tmp_path, durable, raise_at=27, local=auto).fit()
    first = capfd.readouterr().err
    assert "the cost measured)" in first and "the cost the attempt before measured" not in first, first[-3000:]

    resumed = trainer(tmp_path, durable, local=auto)
    resumed.fit()
    err = capfd.readouterr().err
    assert "restored step 24 from the node-local tier" in err, err[-3000:]
    recorded = resumed.run_log.attempts[0][COST_KEY]
    assert recorded > 0
    said = re.search(r"fast-tier copies every [\d.]+ s from now on \(auto, Young/Daly: (\d+) ms a copy, 1 failure\(s\) "
                     r"in \d+ s of training; the cost (.*)\)", err)
    assert said and said.group(2) == "the attempt before measured", err[-3000:]
    assert int(said.group(1)) == round(recorded * 1e3)


@pytest.mark.slow
def test_when_no_fast_copy_verifies_the_durable_store_is_read(tmp_path, capfd):
    durable = memory_url()
    with pytest.raises(ValueError, match="a bug in the user"):
        trainer(tmp_path, durable, raise_at=27).fit()
    for step in local_steps(tmp_path):
        corrupt(tmp_path, step)
    capfd.readouterr()
    resumed = trainer(tmp_path, durable, max_steps=30)
    resumed.fit()
    err = capfd.readouterr().err
    assert "node-local snapshots at" in err and "are not usable" in err
    assert f"restored snapshot {durable}/step-000000000020" in err


def test_a_fast_tier_that_does_not_fit_is_refused_before_its_first_write(tmp_path, monkeypatch, capfd):
    import elastictrain.snapshot.local_tier as local_tier_module

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(local_tier_module.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    durable = memory_url()
    run = trainer(tmp_path, durable)
    with pytest.raises(ConfigError, match=r"needs about .* MB \(2 kept \+ 1 being written.*has 0 MB free"):
        run.fit()
    assert run.progress.global_step == LOCAL_EVERY
    assert local_steps(tmp_path) == []


@pytest.mark.slow
def test_a_restart_onto_a_tier_full_for_now_trains_on_with_warnings_instead_of_stopping(tmp_path, monkeypatch, capfd):
    """Found by the chaos soak: the node's memory filled by something else while a worker restarts. The tier held
    this run's copies (it fits); the restarted attempt's copies fail with warnings, the run goes on to its end."""
    import elastictrain.storage.commit as commit_module
    import elastictrain.snapshot.local_tier as local_tier_module

    durable = memory_url()
    with pytest.raises(ValueError, match="a bug in the user"):
        trainer(tmp_path, durable, raise_at=27).fit()
    assert local_steps(tmp_path) == [20, 24]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(local_tier_module.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit_module.os, "fsync", full)  # every write into the tier fails as on a full tmpfs
    capfd.readouterr()
    summary = trainer(tmp_path, durable).fit()
    err = capfd.readouterr().err
    assert "restored step 24 from the node-local tier of node 0 (rank 0)" in err, err[-3000:]
    assert summary.global_step == 64 and summary.state == "DONE"
    assert "snapshot at step 28 not committed" in err, err[-3000:]


@pytest.mark.slow
def test_fast_copies_are_reported_by_tier_and_given_back_at_done_without_a_final_snapshot(tmp_path):
    from elastictrain.core.events import Observer

    class Reports(Observer):
        def __init__(self) -> None:
            self.seen = []

        def snapshotted(self, report) -> None:
            self.seen.append((report.tier, report.step, report.committed))

    reports = Reports()
    run = trainer(tmp_path, memory_url(), max_steps=12, on_done=False, observers=[reports])
    run.fit()
    # Step 10 is durable and fast; the run ends at 12 with no final snapshot of either tier.
    assert reports.seen == [("local", 4, True), ("local", 8, True), ("local", 10, True), ("durable", 10, True)]
    assert not (tmp_path / "shm" / "default").exists(), "DONE gives the node's memory back"


@pytest.mark.slow
@pytest.mark.parametrize("local, fast_in_background", [({}, False), ({"async_write": True}, True),
                                                       ({"async_write": False}, False)])
def test_the_fast_tier_writes_in_the_background_only_when_its_own_async_write_says_so(tmp_path, local,
                                                                                     fast_in_background):
    from elastictrain.core.events import Observer

    class Reports(Observer):
        def __init__(self) -> None:
            self.background = {}

        def snapshotted(self, report) -> None:  # a background write reports its own seconds apart from the wait
            self.background.setdefault(report.tier, set()).add(report.write_s > 0)

    reports = Reports()
    run = trainer(tmp_path, memory_url(), max_steps=12, on_done=False, async_write=True, local=local, observers=[reports])
    run.fit()
    assert reports.background == {"durable": {True}, "local": {fast_in_background}}


def two_hours_later(monkeypatch) -> None:
    """The tiers' wall clock two hours on (their monotonic clock as it is): whatever the load, snapshot.durable.every_s
    below (one hour) has passed since the first attempt, and never passes within one."""
    import time

    monkeypatch.setattr("elastictrain.train.tiers.time", SimpleNamespace(time=lambda: time.time() + 7200.0,
                                                                   monotonic=time.monotonic))


def test_timed_durable_snapshots_count_from_the_newest_durable_one_across_restarts(tmp_path, monkeypatch):
    """A job that fails more often than snapshot.durable.every_s still gets durable snapshots: a restart
    restored from a fast copy does not start the durable timer again."""
    durable = memory_url()
    with pytest.raises(ValueError, match="a bug in the user"):
        trainer(tmp_path, durable, raise_at=27).fit()
    assert [s.step for s in SnapshotStore(durable).list_snapshots()] == [10, 20]
    two_hours_later(monkeypatch)  # the durable store's newest (step 20) is now older than the interval below
    resumed = trainer(tmp_path, durable, max_steps=40, every_steps=0, every_s=3600.0)
    resumed.fit()
    # Restored from the fast copy at 24 with the durable timer already due: the restored step goes
    # to the durable store at once. Counted from the restart instead, the next durable snapshot
    # would be an hour away: none before the final one at 40.
    assert [s.step for s in SnapshotStore(durable).list_snapshots()] == [20, 24, 40]


def test_timed_durable_snapshots_count_from_the_runs_first_start_while_the_store_has_none(tmp_path, monkeypatch):
    durable = memory_url()
    with pytest.raises(ValueError, match="a bug in the user"):
        trainer(tmp_path, durable, raise_at=27, every_steps=0, every_s=3600.0).fit()
    assert SnapshotStore(durable).list_snapshots() == []  # every attempt ended before the interval
    two_hours_later(monkeypatch)
    trainer(tmp_path, durable, max_steps=40, every_steps=0, every_s=3600.0).fit()
    # The run started over an hour ago: the restored fast copy (step 24) goes to the durable store at once.
    assert [s.step for s in SnapshotStore(durable).list_snapshots()] == [24, 40]


@pytest.mark.slow
def test_a_rollback_heals_from_the_fast_tier_while_the_durable_store_does_not_answer(tmp_path, monkeypatch, capfd):
    """Found by the chaos soak: a NaN batch while the S3 server hung stopped the run in ROLLBACK (the durable store was
    listed and did not answer), so a transient fault cost a restart. This process wrote the store's newest snapshot;
    a fast copy as new is enough."""
    from elastictrain.core.errors import StorageUnavailable

    durable = memory_url()
    monkeypatch.setenv("ELASTICTRAIN_FAULT", f"grad-inf@27:{tmp_path}")
    real = SnapshotStore.latest_valid

    def hung(self, *args, **kwargs):
        if self.url == durable and (tmp_path / "fault-grad-inf.done").exists():
            raise StorageUnavailable(f"the store {durable} did not answer (a test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "latest_valid", hung)
    seed_everything(0)
    task = build(str(tmp_path), train_samples=512, hidden=32)
    summary = Trainer.from_task(task, {
        "snapshot": {"durable": {"url": durable, "every_steps": 10}, "local": {"url": str(tmp_path / "shm"), "every_steps": LOCAL_EVERY}},
        "train": {"max_epochs": 2, "batch_size": 16, "log_every_steps": 5}, "anomaly": {"check_gradients": True},
        "log": {"progress_bar": False},
    }).fit()
    err = capfd.readouterr().err
    assert "rolled back to step 24 from the node-local tier of node 0 (rank 0)" in err, err[-3000:]
    assert "step 27 replayed clean" in err, err[-3000:]
    assert summary.state == "DONE" and summary.global_step == 64
