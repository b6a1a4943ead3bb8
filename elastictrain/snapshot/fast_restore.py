"""dist.strategy=fsdp: restoring from the nodes' fast copies of the shards (``fast_shards.py`` wrote them).

Every node's writer offers what its node holds, each file verified against its node's manifest; the
newest copy whose files the nodes hold *together* (own and peer copies) is chosen (``choose``, pure).
The files a node lacks are sent to it (the lowest rank holding a file broadcasts its bytes; each
node's writer writes them into a staging directory beside its own files, hard-linked), so every rank
then reads its part of the shards from its own node's directory, at any world size (DCP reshards).
One copy is one save: a node's files count together with another node's only where both copies carry
the same DCP ``.metadata`` (the same checksum), so two saves of one step are never mixed.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from elastictrain.core.errors import StorageError
from elastictrain.dist.collectives import all_gather, broadcast_bytes_from_main, broadcast_from_main
from elastictrain.snapshot.fast_shards import METADATA, origin_rank
from elastictrain.snapshot.format import STATE_OBJECT
from elastictrain.storage.hashing import checksum_stream, mismatch
from elastictrain.storage.manifest import Manifest, ObjectEntry

if TYPE_CHECKING:
    from elastictrain.dist.group import DistContext
    from elastictrain.storage.snapshot_store import SnapshotStore

log = logging.getLogger("elastictrain")

CopyKey = tuple[int, str]  # (step, the checksum of its DCP .metadata): one save of one step


class NodeTier(Protocol):
    """What restoring from the nodes' copies reads of the fast tier (local_tier.LocalTier is one): this module
    takes the tier, it never imports the snapshotter that calls it."""

    is_writer: bool  # this rank writes, and so reads, its node's copies
    store: SnapshotStore


@dataclass(frozen=True)
class NodeOffer:
    """One committed copy a node holds: the files that verify, and its manifest."""

    verified: frozenset[str]
    manifest: Manifest

    @property
    def needed(self) -> set[str]:
        """Every file the copy needs, on one node or another: every rank's shards, DCP's index, state.pt."""
        return {*self.manifest.meta.get("shards", []), METADATA, STATE_OBJECT}


def offer(fast: NodeTier) -> dict[CopyKey, NodeOffer]:
    """A node's writer: every committed sharded copy its node holds, each file verified (a file that does not verify is
    left out, with one warning); {} elsewhere."""
    if not fast.is_writer:
        return {}
    offers: dict[CopyKey, NodeOffer] = {}
    try:
        listings = fast.store.list_snapshots()
    except StorageError as exc:  # nothing usable here; another node or the durable store may have it
        log.warning("node-local snapshots at %s are not usable: %s", fast.store.url, exc)
        return {}
    for listing in listings:
        manifest = listing.manifest
        if manifest is None or not manifest.meta.get("sharded") or METADATA not in manifest.objects:
            continue
        verified = set()
        for name, entry in sorted(manifest.objects.items()):
            problem = _problem(os.path.join(fast.store.root, listing.snapshot_id, name), entry)
            if problem is None:
                verified.add(name)
            else:
                log.warning(
                    "skipping %s of the node-local copy %s: %s",
                    name,
                    fast.store.client.where(listing.snapshot_id),
                    problem,
                )
        offers[(manifest.step, manifest.objects[METADATA].digest)] = NodeOffer(frozenset(verified), manifest)
    return offers


def choose(offers: list[dict[CopyKey, NodeOffer]]) -> CopyKey | None:
    """The newest copy whose every file some node holds verified (``offers``: every rank's), or None."""
    held: dict[CopyKey, set[str]] = {}
    needed: dict[CopyKey, set[str]] = {}
    for rank_offers in offers:
        for key, node_offer in rank_offers.items():
            held.setdefault(key, set()).update(node_offer.verified)
            needed.setdefault(key, set()).update(node_offer.needed)
    complete = [key for key in held if needed[key] <= held[key]]
    return max(complete) if complete else None


class FastShardRestore:
    """Bring one chosen copy's files to every node, then hand ``restore.py`` the bytes of state.pt and where to load."""

    def __init__(
        self, fast: NodeTier, ctx: DistContext, key: CopyKey, offers: list[dict[CopyKey, NodeOffer]], nodes: list[int]
    ) -> None:
        self.fast, self.ctx, self.key, self.nodes = fast, ctx, key, nodes
        self.holdings = {rank: rank_offers[key] for rank, rank_offers in enumerate(offers) if key in rank_offers}
        self.staging = os.path.join(fast.store.root, f"restoring-step-{key[0]}")  # not a step-* prefix: no snapshot

    def holder(self, name: str) -> int:
        """The lowest rank whose node holds ``name`` verified."""
        return min(rank for rank, held in self.holdings.items() if name in held.verified)

    def bring(self) -> tuple[Manifest, dict[str, Any], str]:
        """Every rank: the copy's files staged on every node; returns (the manifest of state.pt's holder, {state.pt:
        bytes}, this node's staging directory to load the shards from). StorageError on every rank if a node failed."""
        node = self.nodes[self.ctx.rank]
        own = next((held for rank, held in self.holdings.items() if self.nodes[rank] == node), None)
        needed = sorted(next(iter(self.holdings.values())).needed - {STATE_OBJECT})
        error = self._link_own(own, needed) if self.fast.is_writer else None
        for name in needed:
            lacking = {
                n
                for n in set(self.nodes)
                if not any(name in held.verified for rank, held in self.holdings.items() if self.nodes[rank] == n)
            }
            if not lacking:
                continue
            holder = self.holder(name)
            data = {name: self._read(name)} if self.ctx.rank == holder else None
            received = broadcast_bytes_from_main(data, self.ctx, src=holder)[name]
            if self.fast.is_writer and node in lacking and error is None:
                error = self._stage(name, received)
        holder = self.holder(STATE_OBJECT)
        manifest = broadcast_from_main(
            self.holdings[holder].manifest if self.ctx.rank == holder else None, self.ctx, src=holder
        )
        objects = broadcast_bytes_from_main(
            {STATE_OBJECT: self._read(STATE_OBJECT)} if self.ctx.rank == holder else None, self.ctx, src=holder
        )
        # Every node's staging directory is complete before any of its ranks reads from it (and all learn if one is not).
        errors = [e for e in all_gather(error, self.ctx) if e is not None]
        if errors:
            raise StorageError(
                f"the node-local copy of step {self.key[0]} could not be staged: {errors[0]}; set "
                "snapshot.local.url=null to restore from the durable store — nothing saved is lost"
            )
        return manifest, objects, self.staging

    def sources(self) -> str:
        """Where each rank's shards came from, by the node that wrote them: its own node's copy or a peer's."""
        saved_nodes = next(iter(self.holdings.values())).manifest.meta.get("nodes", [])
        parts: dict[str, list[int]] = {}
        for name in next(iter(self.holdings.values())).needed:
            origin = origin_rank(name)
            if origin is None:
                continue
            holder = self.holder(name)
            kind = "peer" if name in self.holdings[holder].manifest.meta.get("peer_files", []) else "own"
            wrote = f"node {saved_nodes[origin]}'s" if origin < len(saved_nodes) else "the"
            parts.setdefault(f"{wrote} shards (ranks %s) from node {self.nodes[holder]}'s {kind} copy", []).append(
                origin
            )
        return ", ".join(text % ", ".join(map(str, sorted(ranks))) for text, ranks in sorted(parts.items()))

    def done(self) -> None:
        """Every rank, after loading: the staging directories removed once every rank has read its part."""
        all_gather(None, self.ctx)  # a barrier: a node's other ranks may still be reading the staged files
        if self.fast.is_writer:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _link_own(self, own: NodeOffer | None, needed: list[str]) -> str | None:
        """This node's writer: a fresh staging directory holding (hard links to) the files its node holds verified."""
        try:
            shutil.rmtree(self.staging, ignore_errors=True)
            os.makedirs(self.staging)
            for name in needed:
                if own is not None and name in own.verified:
                    source = os.path.join(self.fast.store.root, own.manifest.snapshot_id, name)
                    try:
                        os.link(source, os.path.join(self.staging, name))
                    except OSError:  # a filesystem without hard links: a copy
                        shutil.copyfile(source, os.path.join(self.staging, name))
        except OSError as exc:
            return f"{self.staging}: {exc}"
        return None

    def _stage(self, name: str, data: Any) -> str | None:
        try:
            with open(os.path.join(self.staging, name), "wb") as handle:
                handle.write(data)
        except OSError as exc:
            return f"{name} could not be written into {self.staging}: {exc}"
        return None

    def _read(self, name: str) -> bytes:
        held = self.holdings[self.ctx.rank]
        with open(os.path.join(self.fast.store.root, held.manifest.snapshot_id, name), "rb") as handle:
            return handle.read()


def _problem(path: str, entry: ObjectEntry) -> str | None:
    """Why the file at ``path`` does not match its manifest entry, or None."""
    try:
        with open(path, "rb") as handle:
            found = checksum_stream(handle, entry.algorithm)
    except OSError as exc:
        return f"unreadable ({exc})"
    return mismatch(entry, found)
