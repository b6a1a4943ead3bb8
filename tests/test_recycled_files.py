"""The fast tier's store writes over its oldest snapshot's files instead of new ones.

``SnapshotStore(recycle_keep_last=k)`` on a local path: once k (and at least two) snapshots are
committed, a commit takes over the oldest one, manifest removed first, and writes over its files
in place. What must hold: the bytes read back are the new ones (a shorter object is cut to its
size), the other snapshots stay valid while the write runs, a write killed half-way leaves the
previous snapshot to restore from, and with one snapshot kept nothing is ever torn for it.
"""

import os
import subprocess
import sys

import pytest

from elastictrain.storage.manifest import MANIFEST_NAME, snapshot_id_for_step
from elastictrain.storage.snapshot_store import SnapshotStore

BIG = bytes(range(256)) * 8192  # 2 MiB


def commit(store, step, model=BIG, during=None):
    def write_model(handle):
        handle.write(model[: len(model) // 2])
        if during is not None:
            during()
        handle.write(model[len(model) // 2:])

    return store.commit(step, {"model.pt": write_model, "state.pt": lambda h: h.write(b"state of step %d" % step)}, {})


def inode(url, step, name="model.pt"):
    return os.stat(os.path.join(url, snapshot_id_for_step(step), name)).st_ino


def committed_steps(store):
    return [listing.step for listing in store.list_snapshots() if listing.manifest is not None]


def test_the_oldest_snapshots_files_are_written_over_in_place_and_read_back_new(tmp_path):
    url = str(tmp_path / "fast")
    store = SnapshotStore(url, recycle_keep_last=2)
    commit(store, 10)
    commit(store, 20)
    oldest = inode(url, 10)
    shorter = bytes(reversed(BIG))[: len(BIG) - 12345]
    commit(store, 30, model=shorter)
    assert store.prune(2) == []  # the oldest was taken over, nothing left to prune
    assert committed_steps(store) == [20, 30]
    assert inode(url, 30) == oldest  # the same file, written over
    manifest, payload = store.read_verified(snapshot_id_for_step(30))
    assert payload == {"model.pt": shorter, "state.pt": b"state of step 30"}
    assert store.read_verified(snapshot_id_for_step(20))[1]["model.pt"] == BIG


def test_while_a_recycled_write_runs_the_other_snapshot_stays_valid(tmp_path):
    url = str(tmp_path / "fast")
    store = SnapshotStore(url, recycle_keep_last=2)
    commit(store, 10)
    commit(store, 20)
    seen = []
    commit(store, 30, during=lambda: seen.append((committed_steps(store), store.latest_valid()[0].step)))
    assert seen == [([20], 20)]  # step 10 stopped being a snapshot before its bytes changed


def test_with_one_snapshot_kept_the_only_copy_is_never_written_over(tmp_path):
    url = str(tmp_path / "fast")
    store = SnapshotStore(url, recycle_keep_last=1)
    commit(store, 10)
    seen = []
    with open(os.path.join(url, snapshot_id_for_step(10), "model.pt"), "rb") as old_file:
        commit(store, 20, model=bytes(reversed(BIG)), during=lambda: seen.append(committed_steps(store)))
        assert old_file.read() == BIG  # its bytes were never written over
    assert seen == [[10]]
    store.prune(1)
    assert committed_steps(store) == [20]
    assert store.read_verified(snapshot_id_for_step(20))[1]["model.pt"] == bytes(reversed(BIG))


def test_objects_the_new_snapshot_does_not_write_are_not_carried_over(tmp_path):
    url = str(tmp_path / "fast")
    store = SnapshotStore(url, recycle_keep_last=2)
    commit(store, 10)
    with open(os.path.join(url, snapshot_id_for_step(10), "leftover.bin"), "wb") as handle:
        handle.write(b"from another version")
    commit(store, 20)
    commit(store, 30)
    assert sorted(os.listdir(os.path.join(url, snapshot_id_for_step(30)))) == [MANIFEST_NAME, "model.pt", "state.pt"]


KILLED = """
import os, sys
from elastictrain.storage.snapshot_store import SnapshotStore

def model(handle):
    handle.write(b"x" * 4096)
    os._exit(9)

SnapshotStore(sys.argv[1], recycle_keep_last=2).commit(30, {"model.pt": model, "state.pt": lambda h: h.write(b"s")}, {})
"""


@pytest.mark.slow
def test_a_recycled_write_killed_half_way_leaves_the_newer_snapshot_to_restore_and_is_pruned_later(tmp_path):
    url = str(tmp_path / "fast")
    store = SnapshotStore(url, recycle_keep_last=2)
    commit(store, 10)
    commit(store, 20)
    killed = subprocess.run([sys.executable, "-c", KILLED, url], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr
    listings = {listing.step: listing.problem for listing in store.list_snapshots()}
    assert listings == {20: None, 30: "no manifest (torn or in-progress write)"}  # step 10's files, half new
    manifest, payload = store.latest_valid()
    assert (manifest.step, payload["model.pt"]) == (20, BIG)
    commit(store, 25)  # after the restore from step 20 the run goes on; the torn prefix is not a candidate
    commit(store, 30)
    store.prune(2)
    assert committed_steps(store) == [25, 30]
    assert store.read_verified(snapshot_id_for_step(30))[1]["state.pt"] == b"state of step 30"
