"""restore.node_copy_objects: how a rank gets the bytes of the fast copy the group restores.

Real node-local stores in a temporary directory; the two collectives are replaced by what rank 1 of a
two-rank group would see (its peer, the holder, reports no problem; the bytes it would send are a
marker), so each test can watch which bytes rank 1 ends up with. Every rank loading the holder's very
bytes is what keeps a restore bitwise; test_resume.py runs the same paths under torchrun.
"""

import logging
from types import SimpleNamespace

import pytest

from elastictrain.snapshot import restore
from elastictrain.storage.manifest import snapshot_id_for_step
from elastictrain.storage.snapshot_store import SnapshotStore

SENT = {"model": b"sent by the holder"}


@pytest.fixture
def node(tmp_path, monkeypatch):
    """One node's store holding copies of steps 10 and 20, seen from rank 1 with rank 0 the holder."""
    store = SnapshotStore(str(tmp_path / "shm"))
    for step in (10, 20):
        weights = f"weights of step {step}".encode()
        store.commit(step, {"model": lambda handle, weights=weights: handle.write(weights)}, meta={})
    sent = []
    monkeypatch.setattr(restore, "all_gather", lambda obj, ctx: [None, obj])
    monkeypatch.setattr(restore, "broadcast_bytes_from_main", lambda payload, ctx, src: sent.append(src) or SENT)
    return SimpleNamespace(fast=SimpleNamespace(store=store), ctx=SimpleNamespace(rank=1, world_size=2), sent=sent,
                           store=store)


def holders_copy(node, step=20):
    return node.store.read_verified(snapshot_id_for_step(step))


def test_a_rank_that_read_the_holders_copy_itself_keeps_its_own_bytes(node):
    manifest, _ = holders_copy(node)
    found = holders_copy(node)
    objects, how = restore.node_copy_objects(node.fast, node.ctx, manifest, found, 0, [0, 0])
    assert bytes(objects["model"]) == b"weights of step 20"
    assert how == ", read by every rank from its node" and node.sent == []


def test_a_rank_that_found_another_copy_reads_the_holders_by_its_id(node):
    """Rank 1 found step 10 (say step 20 did not verify when it read): it must load step 20, the holder's."""
    manifest, _ = holders_copy(node)
    objects, how = restore.node_copy_objects(node.fast, node.ctx, manifest, holders_copy(node, step=10), 0, [0, 0])
    assert bytes(objects["model"]) == b"weights of step 20"
    assert how == ", read by every rank from its node" and node.sent == []


def test_a_rank_that_cannot_verify_the_holders_copy_is_sent_the_holders_bytes(node, caplog):
    manifest, _ = holders_copy(node)
    path = node.store.client.where(manifest.snapshot_id) + "/model"
    with open(path, "r+b") as handle:  # corrupted after the holder read and verified it
        handle.write(b"W")
    with caplog.at_level(logging.WARNING, logger="elastictrain"):
        objects, how = restore.node_copy_objects(node.fast, node.ctx, manifest, None, 0, [0, 0])
    assert objects is SENT and node.sent == [0] and how == ", sent to this rank"
    assert "a rank could not read the node-local copy step-000000000020 itself (snapshot" in caplog.text
    assert "xxh3_128 mismatch" in caplog.text


def test_ranks_on_other_nodes_are_sent_the_holders_bytes(node):
    manifest, _ = holders_copy(node)
    objects, how = restore.node_copy_objects(node.fast, node.ctx, manifest, holders_copy(node), 0, [0, 1])
    assert objects is SENT and node.sent == [0] and how == ", sent to this rank"
