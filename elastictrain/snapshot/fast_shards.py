"""dist.strategy=fsdp, the fast tier: each node keeps its own ranks' shards and a copy of its peer node's.

At each fast copy every rank writes its own DCP shard file into its node's directory (one collective
``dcp.save``; each rank passes its own node's path, so DCP's coordinator, rank 0, writes ``.metadata``
on its node only: its bytes are sent to every other node). Each rank then sends its shard file's bytes
to a rank of the *peer node*: node i's shards are kept on node (i + 1) % nnodes too (``peer_ranks``),
so a lost node's shards survive in its peer's memory. DCP names each file after the rank that wrote
it, so a node's own files and its peer's never collide. The rank that writes or receives a file
hashes it; each node's writer (its local rank 0) commits the node's manifest last, listing the files
the node holds with their checksums plus ``state.pt``, through the same ``SnapshotStore.commit`` as
every snapshot, so keep-last, pruning and ``clear`` are those of the DDP fast tier. Restoring from
these copies is ``fast_restore.py``'s.

Not done: a copy written over the oldest one in place (``commit.Committer``'s recycling): DCP opens
its files with "wb", which gives their pages back first, so it would save nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastictrain.core.errors import StorageError
from elastictrain.dist.collectives import all_gather, broadcast_bytes_from_main
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.sharded import ShardedState, ShardFiles
from elastictrain.storage.hashing import checksum_bytes
from elastictrain.storage.snapshot_store import SnapshotStore

METADATA = ".metadata"  # DCP's index of the shards
SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's file of one rank (FileSystemWriter's names)


def peer_ranks(node_of_rank: list[int]) -> list[int | None]:
    """rank -> the rank of the next node (in node order, wrapping) that keeps a copy of its shards; None with one node.

    A rank's peer is the rank at its own position among the next node's ranks (modulo their count): with
    equal nodes of L ranks, rank r's peer is (r + L) % world_size.
    """
    nodes = sorted(set(node_of_rank))
    if len(nodes) < 2:
        return [None] * len(node_of_rank)
    ranks_of = {node: [rank for rank, n in enumerate(node_of_rank) if n == node] for node in nodes}
    peers: list[int | None] = []
    for rank, node in enumerate(node_of_rank):
        following = ranks_of[nodes[(nodes.index(node) + 1) % len(nodes)]]
        peers.append(following[ranks_of[node].index(rank) % len(following)])
    return peers


def origin_rank(name: str) -> int | None:
    """The rank that wrote DCP shard file ``name``; None for any other file."""
    match = SHARD_FILE.match(name)
    return int(match.group(1)) if match else None


@dataclass
class NodeCopy(ShardFiles):
    """What one fast copy left on this node: on its writer, every file its ranks wrote or received, and why not."""

    meta: dict[str, Any] = field(default_factory=dict)  # the manifest's: which files are the peer's, every shard's name


class FastShards:
    """Write one fast copy of every rank's shards into each node's directory, and a copy into the peer node's."""

    def __init__(self, sharded: ShardedState, ctx: DistContext) -> None:
        self.sharded = sharded
        self.ctx = ctx
        self._nodes: list[int] | None = None  # the node of every rank, gathered at the first copy (measure)
        self.node_bytes = 0  # about what this node's directory holds per copy (measure)

    def measure(self) -> list[int]:
        """Every rank, at the first copy (a collective): the node of every rank (returned), and about how many bytes a
        copy takes on this node (its ranks' shards and those it keeps for its peer, each about this rank's size)."""
        if self._nodes is not None:
            return self._nodes
        nodes = self._nodes = all_gather(self.ctx.env.node_rank, self.ctx) if self.ctx.distributed else [0]
        peers = peer_ranks(nodes)
        node = nodes[self.ctx.rank]
        kept = sum(n == node for n in nodes) + sum(peer is not None and nodes[peer] == node for peer in peers)
        self.node_bytes = self.sharded.local_bytes() * kept
        return nodes

    def write(self, store: SnapshotStore, step: int, is_writer: bool) -> NodeCopy:
        """Every rank: this step's shards into ``store`` (this node's), the peer's copies exchanged; the node's
        writer returns what its node's ranks wrote (the others: their own share)."""
        nodes = self.measure()
        peers = peer_ranks(nodes)
        node, prefix = nodes[self.ctx.rank], store.prefix_url(step)
        cleared = None
        if is_writer:
            try:
                store.clear_prefix(step)
            except StorageError as exc:
                cleared = str(exc)
        # Every node's prefix is emptied before any rank writes into it (and all learn whether one could not be).
        errors = [error for error in all_gather(cleared, self.ctx) if error is not None]
        if errors:
            return NodeCopy(error=errors[0])
        try:
            shards = self.sharded.write(prefix, step)  # DCP's errors reach every rank together
        except StorageError as exc:
            return NodeCopy(error=str(exc))
        # This rank's files read back once (DCP records no checksums; they are in the page cache): hashed, and sent on.
        own: dict[str, bytes] = {}
        held = ShardFiles()  # what this rank wrote or received, hashed
        try:
            own = {name: _read(prefix, name) for name in shards if origin_rank(name) == self.ctx.rank}
            metadata = {METADATA: _read(prefix, METADATA)} if self.ctx.is_main else {}
        except OSError as exc:
            own, metadata = {}, {}
            held.error = f"rank {self.ctx.rank} could not read back its shards in {prefix}: {exc}"
        held.written = {name: checksum_bytes(data) for name, data in {**own, **metadata}.items()}
        # DCP's coordinator (rank 0) wrote .metadata on its node alone; every other node's writer keeps its bytes too.
        sent = broadcast_bytes_from_main(metadata if self.ctx.is_main else None, self.ctx).get(METADATA)
        if is_writer and node != nodes[0] and held.error is None:
            if sent is None:
                held.error = "rank 0 could not read back DCP's .metadata"
            else:
                held.keep(_write(prefix, METADATA, sent))
        held.keep(self._exchange(prefix, own, peers))
        shares = all_gather((node, held), self.ctx)
        copy = NodeCopy()
        for _, share in (s for s in shares if s[0] == node):
            copy.keep(share)
        copy.meta = {
            "node": node,
            "nodes": nodes,
            "shards": shards,
            "peer_files": sorted(n for n in copy.written if (o := origin_rank(n)) is not None and nodes[o] != node),
        }
        return copy

    def _exchange(self, prefix: str, own: dict[str, bytes], peers: list[int | None]) -> ShardFiles:
        """Send this rank's shard files (``own``: their bytes) to its peer, receive those of the ranks it keeps into
        this node's ``prefix``; what it received, and why not."""
        senders = [rank for rank, peer in enumerate(peers) if peer == self.ctx.rank and rank != self.ctx.rank]
        mine_to_send = own if peers[self.ctx.rank] is not None else {}
        offered = (
            all_gather({name: len(data) for name, data in mine_to_send.items()}, self.ctx)
            if self.ctx.distributed and peers[self.ctx.rank] is not None
            else [{}] * self.ctx.world_size
        )
        works, sending, buffers = [], [], []
        for data in mine_to_send.values():
            sending.append(self._on_device(torch.frombuffer(bytearray(data), dtype=torch.uint8)))  # alive until sent
            works.append(dist.isend(sending[-1], peers[self.ctx.rank]))
        for sender in senders:
            for name, size in sorted(offered[sender].items()):
                buffer = self._on_device(torch.empty(size, dtype=torch.uint8))
                works.append(dist.irecv(buffer, sender))
                buffers.append((name, buffer))
        for work in works:
            assert work is not None  # None only on a rank outside the group
            work.wait()
        received = ShardFiles()
        for name, buffer in buffers:
            if received.error is None:
                received.keep(_write(prefix, name, buffer.cpu().numpy().tobytes()))
        return received

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.ctx.device) if self.ctx.backend == "nccl" else tensor


def _read(prefix: str, name: str) -> bytes:
    with open(os.path.join(prefix, name), "rb") as handle:
        return handle.read()


def _write(prefix: str, name: str, data: bytes) -> ShardFiles:
    """Write a file another rank sent into this node's prefix (no manifest there yet: it is torn until the commit):
    its size and checksum, or why not."""
    try:
        with open(os.path.join(prefix, name), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return ShardFiles(error=f"{name} could not be written into {prefix}: {exc}")
    return ShardFiles({name: checksum_bytes(data)})
