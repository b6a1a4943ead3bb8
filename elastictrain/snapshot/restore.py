"""Restoring on every rank: which snapshot (the durable store's newest or a node's fast copy), and loading it.

With a fast tier, every node offers the newest copy it holds and verifies; the durable store is
read only when it holds a newer one. The bytes travel from the rank that read them to every
other rank, so every rank loads the very same snapshot; where every rank runs on the node of the
copy restored, each has read it there itself (``node_copy_objects``). With ``dist.strategy=fsdp`` the nodes
offer the shard files they hold, and a copy they hold together is restored (``fast_restore.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch.optim import Optimizer

from elastictrain.core.errors import ConfigError, ElastictrainError, SnapshotError
from elastictrain.core.events import Committed
from elastictrain.core.rng import restore_rng, seed_rng
from elastictrain.dist.collectives import all_gather, broadcast_bytes_from_main, broadcast_from_main, main_acts
from elastictrain.snapshot import fast_restore
from elastictrain.snapshot.fast_restore import NodeTier
from elastictrain.snapshot.format import FORMAT_VERSION, MODEL_OBJECT, STATE_OBJECT, load_model_weights, load_object
from elastictrain.snapshot.resume_checks import (
    check_config,
    check_optimizer_fits,
    start_fresh_advice,
    warn_on_changed_hyperparameters,
)
from elastictrain.snapshot.slots import InSlots, choose_partial, gather_states, node_keys, slot_dir
from elastictrain.storage.manifest import Manifest, Verified

if TYPE_CHECKING:
    from torch import nn

    from elastictrain.core.config import Config
    from elastictrain.dist.group import DistContext
    from elastictrain.snapshot.sharded import ShardedState

log = logging.getLogger("elastictrain")

# Components a user may add or drop between runs (a scheduler, a scaler): a mismatch is a
# warning and the component starts fresh. Every other entry is ours and always present.
_OPTIONAL_COMPONENTS = ("lr_scheduler", "grad_scaler")


class SnapshotTier(NodeTier, Protocol):
    """What restoring reads of a tier and loads into (durable_tier.DurableTier is one, and calls ``restore_newest``
    with itself): this module takes the tier, it never imports the tiers."""

    cfg: Config
    ctx: DistContext
    model: nn.Module  # the unwrapped module
    statefuls: dict[str, Any]
    rank_statefuls: dict[str, Any]
    train_samples: int | None
    sharded: ShardedState | None  # dist.strategy=fsdp
    last_committed: Committed | None


class FastTier(SnapshotTier, Protocol):
    """The node-local tier restoring also reads (local_tier.LocalTier is one)."""

    def join_run(self, run_id: str) -> str | None: ...

    def newest_local(self) -> tuple[Verified | None, Verified | None]: ...

    def newest_below(self, step: int | None) -> Verified | None: ...

    def discard(self, step: int) -> None: ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class Restored:
    snapshot_id: str
    step: int
    saved_world_size: int
    duration_s: float


def restore_newest(
    durable: SnapshotTier, fast: FastTier | None, run_id: str, started: float, keep: tuple[str, ...] = ()
) -> Restored | None:
    """Every rank: load the newest valid snapshot of either tier into ``durable``'s objects; None to start fresh.

    Sets ``durable.last_committed`` to the durable store's newest committed snapshot. ``keep``: a
    rollback in the running process (anomalies.py), which leaves those objects as they are, reads
    the snapshots whatever ``snapshot.resume`` says, and finds the fast tier joined already.
    """
    rollback = bool(keep)
    resume = durable.cfg.snapshot.resume or rollback
    local_steps: tuple[int, ...] = (-1,)
    local_found: Verified | None = None
    partial_found: Verified | None = None  # this node's newest copy, a survivor copy that needs other nodes' slots
    partial: InSlots | None = None
    partial_holder: int | None = None
    shard_offers: dict[fast_restore.CopyKey, fast_restore.NodeOffer] = {}  # this rank's
    every_offer: list[dict[fast_restore.CopyKey, fast_restore.NodeOffer]] = []  # every rank's
    shard_copy: fast_restore.CopyKey | None = None
    if fast is not None:
        refused = None if rollback else fast.join_run(run_id)
        nodes, refusals = zip(*all_gather((durable.ctx.env.node_rank, refused), durable.ctx))
        for refusal in filter(None, refusals):  # every rank stops with the first node's line
            raise ConfigError(refusal)
        if not resume:
            fast.clear()
        elif fast.sharded is not None:  # fsdp: each node offers the files it holds (fast_restore.py)
            shard_offers = fast_restore.offer(fast)
        elif fast.is_writer or len(set(nodes)) == 1:  # on one node every rank reads its copy at once: none is sent
            local_found, partial_found = fast.newest_local()
        local_step = local_found.manifest.step if local_found else -1
        partial = InSlots.from_meta(partial_found.manifest.step, partial_found.manifest.meta) if partial_found else None
        keys = node_keys(slot_dir(fast.store.root)) if fast.is_writer and fast.sharded is None else {}
        local_steps, offers, partials, every_keys = zip(
            *all_gather((local_step, shard_offers, partial, keys), durable.ctx)
        )
        every_offer = list(offers)
        shard_copy = fast_restore.choose(every_offer) if fast.sharded is not None else None
        partial_holder = choose_partial(list(partials), list(every_keys), newer_than=max(local_steps))
        if partial_holder is not None:  # a survivor copy whose missing ranks' slots are all still there: the newest
            chosen = partials[partial_holder]
            assert chosen is not None  # choose_partial chooses a rank that offered one
            local_steps = tuple(chosen.step if rank == partial_holder else s for rank, s in enumerate(local_steps))
            local_found = partial_found if partial_found is not None and partial == chosen else None
        elif any(p is not None for p in partials):
            # Every survivor copy passed over: the ranks that read one read the newest complete copy below it now (not
            # before: the state twice in memory) and the ranks learn the new steps.
            if partial_found is not None:
                partial_found = None
                assert partial is not None  # read with partial_found
                local_found = fast.newest_below(partial.step)
            local_steps = tuple(all_gather(local_found.manifest.step if local_found else -1, durable.ctx))
    newest_local = shard_copy[0] if shard_copy else max(local_steps)
    read: dict[
        str, Any
    ] = {}  # rank 0: the durable snapshot it read, (manifest, payload), when newer than the fast copies

    def newest_durable() -> Manifest | None:
        written = durable.last_committed
        if rollback and newest_local >= 0 and (written.step if written else -1) <= newest_local:
            # This process wrote the durable store's newest (its writes are finished): a fast copy as new is
            # enough, and the store, which may not answer now, need not be read for a transient fault to heal.
            pass
        elif resume:
            read["found"] = durable.store.latest_valid(newer_than=newest_local)
            if read["found"] is None:  # a fast copy or nothing: timed durable snapshots count from the store's newest
                newest = [s.manifest for s in durable.store.list_snapshots() if s.manifest is not None][-1:]
                durable.last_committed = Committed(newest[0].step, newest[0].created_unix) if newest else None
        elif durable.store.list_snapshots():
            # A fresh run writing beside another run's snapshots would mix the two.
            raise SnapshotError(
                f"snapshot.resume=false but {durable.store.url} already holds snapshots; "
                f"{start_fresh_advice(durable.cfg)}, or remove them — nothing was deleted"
            )
        return read["found"].manifest if read.get("found") else None

    manifest = main_acts(newest_durable, durable.ctx)
    found = read.get("found")
    if manifest is not None:  # the durable store's is the newest: rank 0 read it
        local_found = None  # an older fast copy read here: not held while the durable one arrives
        # A sharded snapshot's shards stay where they are: every rank reads its own part of them (sharded.py).
        sharded = manifest.meta.get("sharded")
        sent = (
            {name: data for name, data in found.objects.items() if not sharded or name == STATE_OBJECT}
            if found
            else None
        )
        objects = broadcast_bytes_from_main(sent, durable.ctx)
        load_snapshot(durable, manifest, objects, f"snapshot {durable.store.url}/{manifest.snapshot_id}", keep)
        durable.last_committed = Committed(manifest.step, manifest.created_unix)
    elif (
        shard_copy is not None
    ):  # fsdp: the files the nodes hold together, brought to every node, each rank reading its part
        assert fast is not None  # only the fast tier has shard copies
        copies = fast_restore.FastShardRestore(fast, durable.ctx, shard_copy, every_offer, list(nodes))
        manifest, objects, staged = copies.bring()
        load_snapshot(durable, manifest, objects, f"snapshot {fast.store.url}/{manifest.snapshot_id}", keep, staged)
        copies.done()
        log.info(
            "%s step %d from the node-local tier: %s",
            "rolled back to" if rollback else "restored",
            manifest.step,
            copies.sources(),
        )
    elif newest_local >= 0:  # a node's fast copy: the lowest rank holding the newest one read it
        assert fast is not None  # only the fast tier has node copies
        holder = local_steps.index(newest_local)
        manifest = broadcast_from_main(local_found.manifest if local_found else None, durable.ctx, src=holder)
        objects, how = node_copy_objects(fast, durable.ctx, manifest, local_found, holder, list(nodes))
        in_slots = InSlots.from_meta(manifest.step, manifest.meta)
        states = gather_states(fast.store.root, fast.is_writer, durable.ctx, in_slots) if in_slots else None
        load_snapshot(
            durable, manifest, objects, f"snapshot {fast.store.url}/{manifest.snapshot_id}", keep, states=states
        )
        log.info(
            "%s step %d from the node-local tier of node %d (rank %d)%s%s",
            "rolled back to" if rollback else "restored",
            manifest.step,
            nodes[holder],
            holder,
            " (a survivor copy)" if manifest.meta.get("survivor") else "",
            how,
        )
        if in_slots is not None:
            log.info(
                "the state of rank(s) %s at step %d came from their nodes' survivor slots",
                ", ".join(map(str, in_slots.ranks)),
                manifest.step,
            )
    else:
        manifest = None
    if partial is not None and fast is not None and fast.is_writer:
        # Read at most once: from here on this attempt's ranks write their slots afresh, and no restore could
        # complete it again (left, it would outrank the copies the job writes next).
        if partial_holder is None and (manifest is None or manifest.step < partial.step):
            log.warning(
                "the survivor copy of step %d in %s is not restored: it needs the slots of rank(s) %s, which no node "
                "holds at that step now (a node lost with its memory); removed",
                partial.step,
                fast.store.url,
                ", ".join(map(str, partial.ranks)),
            )
        fast.discard(partial.step)
    if manifest is None:
        return None
    saved_world_size = int(manifest.meta.get("world_size", durable.ctx.world_size))
    return Restored(manifest.snapshot_id, manifest.step, saved_world_size, time.monotonic() - started)


def node_copy_objects(
    fast: FastTier,
    ctx: DistContext,
    manifest: Manifest,
    found: Verified | None,
    holder: int,
    nodes: list[int],
) -> tuple[dict[str, Any], str]:
    """Every rank: the bytes of the fast copy rank ``holder`` read, and how this rank got them. ``found``: what
    ``newest_local`` read on this rank.

    When every rank runs on the holder's node, each has read and verified the node's newest copy itself, all at once,
    and nothing is sent over the process group (benchmarks/goodput.py's 50 MB on 2 cores: a warm restart's restore,
    median by run, fell from 0.15-0.19 s to 0.12-0.13 s). A rank that found another copy reads the holder's; one
    whose read fails, or finds other bytes than the holder's manifest names, makes every rank fall back to the holder
    sending them, as across nodes (where only each node's writer reads: no rank holds two copies at once). Every
    rank loads the very same snapshot either way.
    """
    if len(set(nodes)) == 1:  # the holder's node: as restore_newest chose who reads
        own, problem = None, None
        if found is not None and found.manifest.snapshot_id == manifest.snapshot_id:
            own = found.objects if found.manifest.objects == manifest.objects else None  # the copy the holder read
        if own is None:
            try:
                read_manifest, own = fast.store.read_verified(manifest.snapshot_id)
                if read_manifest.objects != manifest.objects:
                    problem = "its manifest changed since the holder read it"
            except ElastictrainError as exc:
                problem = str(exc)
        problems = [p for p in all_gather(problem, ctx) if p is not None]
        if not problems and own is not None:  # own: read whenever no rank had a problem
            return own, ", read by every rank from its node" if ctx.world_size > 1 else ""
        log.warning(
            "a rank could not read the node-local copy %s itself (%s): rank %d sends it",
            manifest.snapshot_id,
            problems[0],
            holder,
        )
    received = broadcast_bytes_from_main(
        found.objects if ctx.rank == holder and found is not None else None, ctx, src=holder
    )
    return received, ", sent to the other ranks" if holder == ctx.rank else ", sent to this rank"


def load_snapshot(
    target: SnapshotTier,
    manifest: Manifest,
    objects: dict[str, Any],
    where: str,
    keep: tuple[str, ...] = (),
    shards_url: str | None = None,
    states: dict[int, dict[str, Any]] | None = None,
) -> None:
    """Load a snapshot's bytes into ``target``'s model, Statefuls (but those in ``keep``) and this rank's RNG,
    after the resume checks. ``shards_url``: where a sharded one's shards are (default: ``target``'s store).
    ``states``: ranks' states the snapshot leaves in their nodes' slots (``slots.gather_states``), by rank."""
    sharded = bool(manifest.meta.get("sharded"))
    if sharded != (target.sharded is not None):
        strategy = "fsdp" if sharded else "ddp"
        raise SnapshotError(
            f"{where} was taken with dist.strategy={strategy}, this run has dist.strategy="
            f"{target.cfg.dist.strategy}; resume with dist.strategy={strategy} (`elastictrain snapshots "
            f"export` writes its weights for a new run) — nothing was deleted"
        )
    for name in (STATE_OBJECT,) if sharded else (MODEL_OBJECT, STATE_OBJECT):
        if name not in objects:
            raise SnapshotError(f"{where} has no {name!r} object; it was not written by elastictrain")
    weights = None if sharded else load_object(objects[MODEL_OBJECT], where, target.ctx.device)
    state = load_object(objects[STATE_OBJECT], where, target.ctx.device)
    for rank, rank_state in (states or {}).items():  # the ranks whose state a survivor copy left in their slots
        state["rng"][rank] = rank_state["rng"]
        for name, saved_ranks in state["rank_states"].items():
            saved_ranks[rank] = rank_state[name]
    if state.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(
            f"{where} has format {state.get('format_version')}, this elastictrain reads format {FORMAT_VERSION}; "
            f"use the elastictrain version that wrote it, or {start_fresh_advice(target.cfg)} — nothing was deleted"
        )
    if (
        target.sharded is not None
    ):  # the model and optimizers: every rank reads its part of the shards, at any world size
        target.sharded.load(shards_url or target.store.prefix_url(manifest.step), where)
    else:
        assert weights is not None  # not sharded: read above
        load_model_weights(target.model, weights, where, start_fresh_advice(target.cfg))
    check_config(target.cfg, target.train_samples, state.get("config", {}), state["env"], where)
    for name, component in target.statefuls.items():  # before anything is loaded: all or nothing
        if (
            isinstance(component, Optimizer)
            and "param_groups" in (state.get(name) or {})
            and name not in keep
            and not sharded
        ):  # fsdp: the optimizers load from the shards
            check_optimizer_fits(component, state[name], f"{where} ({name!r})", target.cfg)
    if target.statefuls.get("optimizer") is not None and state.get("optimizer") is not None:
        warn_on_changed_hyperparameters(target.statefuls["optimizer"], state["optimizer"], where, target.cfg)
    for name, component in target.statefuls.items():
        if name in keep:
            continue
        saved = state.get(name)
        if sharded and isinstance(component, Optimizer):
            continue  # loaded from the shards
        if component is not None and saved is not None:
            component.load_state_dict(saved)
        elif name in _OPTIONAL_COMPONENTS and (component is None) != (saved is None):
            log.warning(
                "%s: %s is %s in the snapshot but %s in this run; it starts fresh",
                where,
                name,
                "absent" if saved is None else "present",
                "absent" if component is None else "present",
            )
    progress = target.statefuls["progress"]
    saved_env = state["env"]
    for name, component in target.rank_statefuls.items():
        saved_ranks = state["rank_states"].get(name)
        if saved_ranks is None:  # the run saved has no such per-rank state (its data was of another kind)
            continue
        if saved_env["world_size"] != target.ctx.world_size and hasattr(component, "load_resharded"):
            component.load_resharded(saved_ranks, target.ctx.rank)
            continue
        if saved_env["world_size"] != target.ctx.world_size:
            raise SnapshotError(
                f"{where} was taken with world size {saved_env['world_size']}, this run has {target.ctx.world_size}, "
                f"and {name} is a stream whose per-rank positions cannot be re-sharded; resume with "
                f"{saved_env['world_size']} workers, or use a map-style Dataset to change the world size"
            )
        component.load_state_dict(saved_ranks[target.ctx.rank])
    if saved_env["world_size"] == target.ctx.world_size:
        restore_rng(state["rng"][target.ctx.rank], target.ctx.device)
    elif target.cfg.train.virtual_shards:
        log.info(
            "%s was taken with world size %d, this run has %d: data position re-sharded from sample %d of "
            "epoch %d; each virtual shard seeds its own RNG stream (train.virtual_shards), so the numbers "
            "stay bitwise those of an unbroken run",
            where,
            saved_env["world_size"],
            target.ctx.world_size,
            progress.epoch_offset,
            progress.epoch,
        )
    else:
        # The data position re-shards exactly; per-rank random streams cannot, so they are
        # re-seeded from the step (the same on every restart with this world size).
        seed_rng(target.cfg.run.seed + target.ctx.rank + 1_000_003 * progress.global_step)
        log.warning(
            "%s was taken with world size %d, this run has %d: data position re-sharded from sample %d of epoch %d, "
            "RNG streams re-seeded (results will not be bitwise equal to an unbroken run)",
            where,
            saved_env["world_size"],
            target.ctx.world_size,
            progress.epoch_offset,
            progress.epoch,
        )
    log.info(
        "%s %s: step %d, epoch %d, sample %d of the epoch",
        "rolled back to" if keep else "restored",
        where,
        progress.global_step,
        progress.epoch,
        progress.epoch_offset,
    )
