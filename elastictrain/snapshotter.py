"""Taking and restoring snapshots: from live objects to committed bytes and back, on every rank.

``Snapshotter`` owns the whole path. Saving gathers every rank's RNG state on rank 0, which
streams the model and every registered Stateful into the store (manifest last), prunes, and
then tells every rank the outcome in one broadcast, so all ranks agree at once whether the
snapshot exists and whether training goes on. Restoring has rank 0 read and verify the newest
valid snapshot and hand its bytes to every rank, so every rank loads the very same one.

A store that cannot be reached is retried by the store (with backoff, ``snapshot.retry_for_s``)
and then given up *for this snapshot only*: training goes on, one warning says since when
snapshots are behind, and the next interval tries again. A write that fails for good (disk
full, permission denied) stops the run cleanly by default (``snapshot.on_error``).

It imports nothing of the loop: the loop hands it the objects to save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import errors, failpoints
from .collectives import all_gather, broadcast_bytes_from_main, broadcast_from_main, gather_to_main
from .config import Config
from .dist import DistContext
from .errors import ConfigError, ElastictrainError, SnapshotError, StorageError, StorageUnavailable, StoreLeaseError
from .events import SnapshotReport
from .staging import Stager
from .snapshot import (
    FORMAT_VERSION,
    MODEL_OBJECT,
    STATE_OBJECT,
    capture_rng,
    load_model_weights,
    load_object,
    restore_rng,
    save_object,
    seed_rng,
    writer_for,
)
from .storage import Manifest, SnapshotStore

log = logging.getLogger("elastictrain")

# Components a user may add or drop between runs (a scheduler, a scaler): a mismatch is a
# warning and the component starts fresh. Every other entry is ours and always present.
_OPTIONAL_COMPONENTS = ("lr_scheduler", "grad_scaler")

TORCHRUN_DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id when none is given: shared by unrelated jobs

# Config keys whose change makes a resume wrong: another data order, other data, another model
# or another batch geometry inside one run. Any other change is logged in one line and applied.
RESUME_CRITICAL_KEYS = ("run.seed", "task.factory", "task.args", "train.batch_size", "train.grad_accum_steps", "data.shuffle",
                        "train.virtual_shards", "train_data.len")


@dataclass(frozen=True)
class Restored:
    snapshot_id: str
    step: int
    saved_world_size: int
    duration_s: float


class Snapshotter:
    """Save and restore the model plus every Stateful in ``statefuls`` (name -> object or None)."""

    def __init__(self, cfg: Config, ctx: DistContext, model: nn.Module, statefuls: dict[str, Any],
                 train_samples: int | None = None, rank_statefuls: dict[str, Any] | None = None,
                 tier: str = "durable") -> None:
        self.cfg = cfg
        # "durable": rank 0 writes snapshot.url and every rank agrees on the outcome. "local": the
        # fast tier, where each node's local rank 0 keeps its own full copy (the state is the same
        # on every rank under DDP, and every rank's RNG is gathered to each writer); a failed fast
        # copy is a warning, never a stop.
        self.tier = tier
        if tier == "durable":
            url, options, retry_for_s = cfg.snapshot_url, cfg.snapshot.storage_options, cfg.snapshot.retry_for_s
            self.keep_last, self.on_error, self.is_writer = cfg.snapshot.keep_last, cfg.snapshot.on_error, ctx.is_main
        else:
            url, options, retry_for_s = cfg.local_snapshot_url, {}, min(2.0, cfg.snapshot.retry_for_s)
            self.keep_last, self.on_error, self.is_writer = cfg.snapshot.local_keep_last, "continue", ctx.env.local_rank == 0
        self._size_checked = False
        self._run_name_dir: str | None = None  # the fast tier's directory of run.name, once joined to the run (join_run)
        # Statefuls whose state differs per rank (a stream's position), saved as one entry per rank.
        self.rank_statefuls = rank_statefuls or {}
        self.train_samples = train_samples  # the data position counts samples: another size is another dataset
        self.ctx = ctx
        self.model = model  # the unwrapped module: its weights are the model object
        self.statefuls = statefuls
        self.store = SnapshotStore(url, options, retry_for_s=retry_for_s,
                                   recycle_keep_last=self.keep_last if tier == "local" else 0,
                                   url_key="snapshot.url" if tier == "durable" else "snapshot.local_url")
        self.last_committed: tuple[int, float] | None = None  # (step, unix time) of the newest committed snapshot
        self._behind_since: tuple[int, float] | None = None  # first failed snapshot while behind
        self._lease: LeaseKeeper | None = None
        # snapshot.async_write (the fast tier: local_async_write): stage into reused buffers, write in a thread, one at a time.
        local_async = cfg.snapshot.local_async_write
        self.asynchronous = cfg.snapshot.async_write if tier == "durable" or local_async is None else local_async
        self._stager = Stager()
        self._in_flight: BackgroundWrite | None = None
        self._write_failed: str | None = None  # a background write failed for good: the run stops
        self._write_crash: BaseException | None = None
        self._reports: list[SnapshotReport] = []  # finished background writes not yet reported

    @property
    def url(self) -> str:
        return self.store.url

    # -- restore ------------------------------------------------------------------------------

    def restore(self, fast: Snapshotter | None = None) -> Restored | None:
        """Load the newest valid snapshot on every rank; None when training starts fresh.

        With a fast tier, every node offers the newest copy it holds and verifies; the durable
        store is read only when it holds a newer one. The bytes travel from the rank that read
        them to every other rank.
        """
        started = time.monotonic()
        run_id = self._open_store()
        local_steps, local_found = [-1], None
        if fast is not None:
            refused = fast.join_run(run_id)
            if refused is None:
                local_found = fast.newest_local() if self.cfg.snapshot.resume else fast.clear()
            offer = (local_found[0].step if local_found else -1, self.ctx.env.node_rank, refused)
            local_steps, nodes, refusals = zip(*all_gather(offer, self.ctx))
            for refusal in filter(None, refusals):  # every rank stops with the first node's line
                raise ConfigError(refusal)
        newest_local = max(local_steps)
        found, error = None, None
        if self.ctx.is_main:
            try:
                if self.cfg.snapshot.resume:
                    found = self.store.latest_valid(newer_than=newest_local)
                    if found is None:  # a fast copy or nothing: timed durable snapshots count from the store's newest
                        committed = [s.manifest for s in self.store.list_snapshots() if s.manifest is not None]
                        self.last_committed = (committed[-1].step, committed[-1].created_unix) if committed else None
                elif self.store.list_snapshots():
                    # A fresh run writing beside another run's snapshots would mix the two.
                    raise SnapshotError(
                        f"snapshot.resume=false but {self.store.url} already holds snapshots; "
                        f"{start_fresh_advice(self.cfg)}, or remove them — nothing was deleted"
                    )
            except ElastictrainError as exc:
                error = (type(exc).__name__, str(exc))
        manifest, error = broadcast_from_main((found[0] if found else None, error), self.ctx)
        if error is not None:
            raise getattr(errors, error[0], ElastictrainError)(error[1])
        if manifest is not None:  # the durable store's is the newest: rank 0 read it
            objects = broadcast_bytes_from_main(found[1] if found else None, self.ctx)
            self._load(manifest, objects, f"snapshot {self.store.url}/{manifest.snapshot_id}")
            self.last_committed = (manifest.step, manifest.created_unix)
        elif newest_local >= 0:  # a node's fast copy: the lowest rank holding the newest one sends it
            holder = local_steps.index(newest_local)
            manifest = broadcast_from_main(local_found[0] if local_found else None, self.ctx, src=holder)
            objects = broadcast_bytes_from_main(local_found[1] if local_found else None, self.ctx, src=holder)
            self._load(manifest, objects, f"snapshot {fast.store.url}/{manifest.snapshot_id}")
            log.info("restored step %d from the node-local tier of node %d (rank %d)%s%s", manifest.step, nodes[holder],
                     holder, " (a survivor copy)" if manifest.meta.get("survivor") else "",
                     "" if holder == self.ctx.rank else ", sent to this rank")
        else:
            return None
        saved_world_size = int(manifest.meta.get("world_size", self.ctx.world_size))
        return Restored(manifest.snapshot_id, manifest.step, saved_world_size, time.monotonic() - started)

    def _open_store(self) -> str:
        """Rank 0 checks that the durable store is writable, takes its lease and reads the run's id; every rank
        returns the id, or raises rank 0's error."""
        run_id, error = None, None
        if self.ctx.is_main:
            try:
                self.store.check_writable()
                self._lease = LeaseKeeper(self.store, self.cfg, self.ctx)
                self._lease.start()
                run_id = self.store.run_id()
            except ElastictrainError as exc:
                error = (type(exc).__name__, str(exc))
        run_id, error = broadcast_from_main((run_id, error), self.ctx)
        if error is not None:
            raise getattr(errors, error[0], ElastictrainError)(error[1])
        return run_id

    def join_run(self, run_id: str) -> str | None:
        """The fast tier, on every rank: keep this node's copies under the run's id (``SnapshotStore.run_id``).

        A copy in another id's directory belongs to another run (the same run.name with another or
        an emptied durable store): the node's writer skips it with one line and leaves it alone.
        Returns why the tier cannot be used here (its directory is not writable), or None.
        """
        base = self._run_name_dir = self.cfg.local_snapshot_url
        old = self.store
        self.store = SnapshotStore(os.path.join(base, run_id), retry_for_s=old.retry_for_s,
                                   recycle_keep_last=old.recycle_keep_last, url_key=old.url_key)
        if not self.is_writer:
            return None
        try:
            self.store.check_writable()
        except StorageError as exc:
            return (f"snapshot.local_url={self.cfg.snapshot.local_url} cannot be used on this node: {exc} (or set "
                    "snapshot.local_url=null to train without the fast tier) — nothing saved is lost")
        for other in _other_runs_copies(base, run_id):
            log.warning("skipping the node-local copies in %s: they belong to another run of this run.name (not to the "
                        "durable store %s) and are never restored here; remove that directory to give its memory back",
                        other, self.cfg.snapshot_url)
        return None

    def newest_local(self) -> tuple[Manifest, dict[str, bytes]] | None:
        """This node's newest fast copy that verifies (on each node's writer; None elsewhere)."""
        if not self.is_writer:
            return None
        try:
            return self.store.latest_valid()
        except ElastictrainError as exc:  # nothing usable here; another node or the durable store may have one
            log.warning("node-local snapshots at %s are not usable: %s", self.store.url, exc)
            return None

    def clear(self) -> None:
        """Remove this node's fast copies (at DONE, PREEMPTED, or when a run starts fresh)."""
        if not self.is_writer:
            return
        self._join_write()
        try:
            if self.store.fs.exists(self.store.root):
                self.store.fs.rm(self.store.root, recursive=True)
            if self._run_name_dir is not None:
                with contextlib.suppress(OSError):  # the run.name's directory, once no run's copies are left in it
                    os.rmdir(self._run_name_dir)
                root = os.path.dirname(self._run_name_dir)  # snapshot.local_url itself, once empty (never a mount point)
                if not os.path.ismount(root):
                    with contextlib.suppress(OSError):
                        os.rmdir(root)
        except OSError as exc:
            log.warning("could not remove the node-local snapshots at %s: %s", self.store.url, exc)

    def _load(self, manifest: Manifest, objects: dict[str, bytes], where: str) -> None:
        for name in (MODEL_OBJECT, STATE_OBJECT):
            if name not in objects:
                raise SnapshotError(f"{where} has no {name!r} object; it was not written by elastictrain")
        weights = load_object(objects[MODEL_OBJECT], where, self.ctx.device)
        state = load_object(objects[STATE_OBJECT], where, self.ctx.device)
        if state.get("format_version") != FORMAT_VERSION:
            raise SnapshotError(
                f"{where} has format {state.get('format_version')}, this elastictrain reads format {FORMAT_VERSION}; "
                f"use the elastictrain version that wrote it, or {start_fresh_advice(self.cfg)} — nothing was deleted"
            )
        load_model_weights(self.model, weights, where, start_fresh_advice(self.cfg))
        self._check_config(state.get("config", {}), state["env"], where)
        if self.statefuls.get("optimizer") is not None and state.get("optimizer") is not None:
            _warn_on_changed_hyperparameters(self.statefuls["optimizer"], state["optimizer"], where)
        for name, component in self.statefuls.items():
            saved = state.get(name)
            if component is not None and saved is not None:
                component.load_state_dict(saved)
            elif name in _OPTIONAL_COMPONENTS and (component is None) != (saved is None):
                log.warning("%s: %s is %s in the snapshot but %s in this run; it starts fresh", where, name,
                            "absent" if saved is None else "present", "absent" if component is None else "present")
        progress = self.statefuls["progress"]
        saved_env = state["env"]
        for name, component in self.rank_statefuls.items():
            if saved_env["world_size"] != self.ctx.world_size:
                raise SnapshotError(
                    f"{where} was taken with world size {saved_env['world_size']}, this run has {self.ctx.world_size}, "
                    f"and {name} is a stream whose per-rank positions cannot be re-sharded; resume with "
                    f"{saved_env['world_size']} workers, or use a map-style Dataset to change the world size"
                )
            component.load_state_dict(state["rank_states"][name][self.ctx.rank])
        if saved_env["world_size"] == self.ctx.world_size:
            restore_rng(state["rng"][self.ctx.rank], self.ctx.device)
        elif self.cfg.train.virtual_shards:
            log.info("%s was taken with world size %d, this run has %d: data position re-sharded from sample %d of "
                     "epoch %d; each virtual shard seeds its own RNG stream (train.virtual_shards), so the numbers "
                     "stay bitwise those of an unbroken run", where, saved_env["world_size"], self.ctx.world_size,
                     progress.epoch_offset, progress.epoch)
        else:
            # The data position re-shards exactly; per-rank random streams cannot, so they are
            # re-seeded from the step (the same on every restart with this world size).
            seed_rng(self.cfg.run.seed + self.ctx.rank + 1_000_003 * progress.global_step)
            log.warning(
                "%s was taken with world size %d, this run has %d: data position re-sharded from sample %d of epoch %d, "
                "RNG streams re-seeded (results will not be bitwise equal to an unbroken run)",
                where, saved_env["world_size"], self.ctx.world_size, progress.epoch_offset, progress.epoch,
            )
        log.info("restored %s: step %d, epoch %d, sample %d of the epoch", where, progress.global_step,
                 progress.epoch, progress.epoch_offset)

    def _check_config(self, saved: dict[str, Any], saved_env: dict[str, Any], where: str) -> None:
        """One line naming every key that changed since the snapshot; refuse the changes that make a resume wrong."""
        changes = config_changes(saved, self.cfg.to_dict(redact=True))
        if saved_env.get("train_samples") != self.train_samples and "train_samples" in saved_env:
            changes["train_data.len"] = (saved_env["train_samples"], self.train_samples)
        if not changes:
            return
        accepted = self.cfg.snapshot.accept_changes
        critical = [key for key in changes if _under(key, RESUME_CRITICAL_KEYS) and not _under(key, accepted)]
        if critical:
            shown = ", ".join(f"{key}={changes[key][0]!r} (this run: {changes[key][1]!r})" for key in critical)
            raise SnapshotError(
                f"{where} was made with {shown}: resuming would change the data or the batch geometry in the middle "
                f"of the run; {start_fresh_advice(self.cfg)}, or accept it with "
                f"snapshot.accept_changes=[{','.join(critical)}] — nothing was deleted"
            )
        log.warning("%s was made with another config; resuming with this run's: %s", where,
                    ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items()))

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any]) -> SnapshotReport | None:
        """Take a snapshot of this step on every rank; every rank returns the same report or raises the same error.

        Written in the background (``snapshot.async_write``), it returns None: the report comes
        from ``poll`` once the write is done, and ``flush`` waits for it.
        """
        started = time.monotonic()
        mine = {"rng": capture_rng(self.ctx.device), **self.rank_state()}
        if self.tier == "local":
            return self._save_local(step, mine, meta, started)
        rank_states = gather_to_main(mine, self.ctx)
        outcome = None
        if self.ctx.is_main:
            outcome = self._start_write(step, rank_states, meta, started) if self.asynchronous else \
                self._commit(step, self.model.state_dict(), self._state_dict(rank_states), meta, started)
        # The one point where all ranks learn the outcome together: nobody trains on while
        # rank 0 is about to stop, and nobody waits on a collective for a rank that left.
        committed, size, error, stop = broadcast_from_main(outcome, self.ctx)
        if stop:
            raise StorageError(error)
        if committed and not self.ctx.is_main:
            self.last_committed = (step, time.time())  # every rank knows the newest committed step
        if self.asynchronous and error is None:
            return None
        return SnapshotReport(step, committed, time.monotonic() - started, size, error, tier=self.tier)

    def _save_local(self, step: int, mine: dict, meta: dict[str, Any], started: float) -> SnapshotReport | None:
        """Each node's writer keeps its own copy; the ranks agree only that every copy fits its node.

        One exchange does both: every rank's RNG (and per-rank state) travels to every writer with
        the writers' refusals (the previous copy failed for good, or the first does not fit).
        """
        refused = None
        if self.is_writer:
            self._join_write()  # the previous fast copy: a crash of its writer stops every rank now
            if self._write_failed is not None:
                refused = ("StorageError", self._write_failed)
            elif not self._size_checked:
                fits = self._check_fits([mine] * self.ctx.world_size)  # the size, from this rank's share
                refused = None if fits is None else ("ConfigError", fits)
                self._size_checked = True
        exchanged = all_gather((mine, refused), self.ctx)
        rank_states = [ranks for ranks, _ in exchanged]
        refusals = [r for _, r in exchanged if r is not None]
        if refusals:
            if self._write_crash is not None:
                raise self._write_crash  # a bug in the writer keeps its traceback on its rank
            raise getattr(errors, refusals[0][0])(refusals[0][1])
        if not self.is_writer:
            return None
        if self.asynchronous:
            self._start_write(step, rank_states, meta, started)
            return None
        committed, size, error, _ = self._commit(step, self.model.state_dict(), self._state_dict(rank_states), meta, started)
        return SnapshotReport(step, committed, time.monotonic() - started, size, error, tier=self.tier)

    def save_survivor(self, step: int, rank_states: list[dict], meta: dict[str, Any]) -> SnapshotReport | None:
        """The fast tier, on the node's lowest surviving rank after a peer was lost: commit ``step`` from the live
        model and every rank's state (``survivor.py``), with no collective (the group is broken). None when the
        tier already holds a committed copy of this step."""
        started = time.monotonic()
        self._join_write()  # this rank's own copy in flight first: one writer at a time
        if any(s.step == step and s.manifest is not None for s in self.store.list_snapshots()):
            return None
        committed, size, error, _ = self._commit(step, self.model.state_dict(), self._state_dict(rank_states), meta, started)
        return SnapshotReport(step, committed, time.monotonic() - started, size, error, tier=self.tier)

    def rank_state(self) -> dict[str, Any]:
        """This rank's share of a snapshot besides its RNG: its streams' positions."""
        return {name: component.state_dict() for name, component in self.rank_statefuls.items()}

    def _check_fits(self, rank_states: list[dict]) -> str | None:
        """The fast tier must not fill the node's memory: its size is known now, before the first write."""
        state_bytes = _tensor_bytes(self.model.state_dict()) + _tensor_bytes(self._state_dict(rank_states))
        needed = state_bytes * (self.keep_last + 1)  # the kept copies and the one being written
        path = self.store.root
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        free = shutil.disk_usage(path).free
        if needed <= free:
            return None
        return (f"the node-local snapshot tier {self.store.url} needs about {needed / 1e6:.0f} MB "
                f"({self.keep_last} kept + 1 being written, {state_bytes / 1e6:.0f} MB each) but {path} has "
                f"{free / 1e6:.0f} MB free; lower snapshot.local_keep_last, point snapshot.local_url at a larger "
                "node-local path, or set it to null — the durable snapshots are untouched")

    # -- asynchronous writes: stage at the step boundary, write in the background ----------

    def _start_write(self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float) -> tuple:
        """Rank 0: wait for the write in flight, stage this step's state into reused buffers, write it in a thread."""
        self._join_write()  # at most one in flight: staging reuses the buffers the last one wrote from
        if self._write_failed is not None:
            return False, 0, self._write_failed, True
        if self._lease is not None and self._lease.lost is not None:
            return False, 0, f"snapshot at step {step} not written: {self._lease.lost}", True
        staged = self._stager.stage({MODEL_OBJECT: self.model.state_dict(), STATE_OBJECT: self._state_dict(rank_states)})
        blocked_s = time.monotonic() - started
        self._in_flight = BackgroundWrite(
            step, blocked_s, lambda: self._commit(step, staged[MODEL_OBJECT], staged[STATE_OBJECT], meta, time.monotonic()))
        return False, 0, None, False

    def poll(self) -> list[SnapshotReport]:
        """Rank 0, between steps: the reports of background writes finished since the last poll."""
        if self._in_flight is not None and not self._in_flight.running:
            self._join_write()
        reports, self._reports = self._reports, []
        return reports

    @property
    def write_failed(self) -> bool:
        """Rank 0: a background write failed for good (or crashed); the ranks must stop at the next vote."""
        return self._write_failed is not None

    def raise_write_failure(self) -> None:
        """Every rank, once the vote agreed that rank 0's background write failed: stop with one line."""
        if self._write_crash is not None:
            raise self._write_crash  # a bug in the writer keeps its traceback
        raise StorageError(self._write_failed or "rank 0's background snapshot write failed for good (its log says why); "
                           "the next launch resumes from the newest committed snapshot")

    def flush(self) -> list[SnapshotReport]:
        """Every rank, before DONE and PREEMPTED: wait for the background write and agree on its outcome."""
        if not self.asynchronous:
            return []
        outcome = None
        if self.ctx.is_main:
            self._join_write()
            outcome = (self.poll(), self._write_failed)
        reports, failed = broadcast_from_main(outcome, self.ctx)
        if failed is not None:
            self._write_failed = failed
            self.raise_write_failure()
        committed = [report.step for report in reports if report.committed]
        if committed and not self.ctx.is_main:
            self.last_committed = (committed[-1], time.time())
        return reports

    def _join_write(self) -> None:
        """Wait for the write in flight; its report waits for ``poll``."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        flight.join()
        if flight.crash is not None:
            self._write_crash = flight.crash
            self._write_failed = f"the background snapshot write of step {flight.step} crashed: {flight.crash!r}"
            self._reports.append(SnapshotReport(flight.step, False, flight.blocked_s, 0, self._write_failed, flight.write_s,
                                                self.tier))
            return
        committed, size, error, stop = flight.outcome
        if stop:
            self._write_failed = error
        self._reports.append(SnapshotReport(flight.step, committed, flight.blocked_s, size, error, flight.write_s, self.tier))

    # -- the commit itself (rank 0) -----------------------------------------------------------

    def _commit(self, step: int, model_state: dict[str, Any], state: dict[str, Any], meta: dict[str, Any],
                started: float) -> tuple:
        def write_state(fileobj: Any) -> None:
            failpoints.hit("snapshot-write", step)  # tests: kill rank 0 after model.pt, before state.pt
            save_object(state, fileobj)  # torch.save without the zip CRC-32: the store checksums every byte

        writers = {MODEL_OBJECT: writer_for(model_state), STATE_OBJECT: write_state}
        if self._lease is not None and self._lease.lost is not None:
            return False, 0, f"snapshot at step {step} not written: {self._lease.lost}", True
        try:
            manifest = self.store.commit(step, writers, {**meta, "format_version": FORMAT_VERSION})
        except StorageError as exc:
            stop = not isinstance(exc, StorageUnavailable) and self.on_error == "stop"
            return False, 0, self._fell_behind(step, exc, stop), stop
        self.last_committed = (step, manifest.created_unix)
        try:
            pruned = self.store.prune(self.keep_last)
        except StorageError as exc:  # old snapshots stay a little longer; the new one is safe
            log.warning("snapshot %s committed, but pruning older ones failed: %s", manifest.snapshot_id, exc)
            pruned = []
        size = sum(entry.size for entry in manifest.objects.values())
        log.info("snapshot %s/%s committed: %d bytes in %.3fs%s", self.store.url, manifest.snapshot_id, size,
                 time.monotonic() - started, f" (pruned {', '.join(pruned)})" if pruned else "")
        if self._behind_since is not None:
            log.info("snapshots caught up at step %d after %.0f s behind", step, time.time() - self._behind_since[1])
            self._behind_since = None
        return True, size, None, False

    def _fell_behind(self, step: int, exc: StorageError, stop: bool) -> str:
        if self._behind_since is None:
            self._behind_since = (step, time.time())
        if self.last_committed is None:
            last = "no snapshot of this run is committed yet"
        else:
            last_step, last_unix = self.last_committed
            last = (f"the newest committed one is step {last_step} from {time.strftime('%H:%M:%S', time.localtime(last_unix))}, "
                    f"{time.time() - last_unix:.0f} s ago")
        if stop:
            return (f"snapshot at step {step} failed: {exc}; stopping (snapshot.on_error=stop); {last}; "
                    "the next launch resumes from it")
        log.warning("snapshot at step %d not committed (%s); snapshots are behind since step %d: %s; training goes on "
                    "and the next snapshot interval tries again", step, exc, self._behind_since[0], last)
        return str(exc)

    def _state_dict(self, rank_states: list[dict]) -> dict[str, Any]:
        """Everything but the model weights; the model is its own payload object."""
        return {
            "format_version": FORMAT_VERSION,
            **{name: (c.state_dict() if c is not None else None) for name, c in self.statefuls.items()},
            "rng": [ranks["rng"] for ranks in rank_states],
            "rank_states": {name: [ranks[name] for ranks in rank_states] for name in self.rank_statefuls},
            "config": self.cfg.to_dict(redact=True),
            "env": {
                "world_size": self.ctx.world_size,
                "num_threads": torch.get_num_threads(),
                "torch_version": str(torch.__version__),  # TorchVersion is not a plain str
                "train_samples": self.train_samples,
            },
        }

    def close(self) -> None:
        if self._in_flight is not None:  # leaving for any reason: a snapshot half written would be lost
            self._in_flight.join(timeout=max(60.0, 3 * self.cfg.snapshot.retry_for_s))
            self._in_flight = None
        if self._lease is not None:
            self._lease.stop()
            self._lease = None


class BackgroundWrite:
    """One snapshot written by a daemon thread; its outcome is read on the training thread after ``join``."""

    def __init__(self, step: int, blocked_s: float, write: Any) -> None:
        self.step = step
        self.blocked_s = blocked_s  # training blocked to stage it
        self.write_s = 0.0
        self.outcome: tuple | None = None  # what Snapshotter._commit returns
        self.crash: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"elastictrain-snapshot-{step}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self, write: Any) -> None:
        started = time.monotonic()
        try:
            self.outcome = write()
        except BaseException as exc:  # reported on the training thread, never lost
            log.exception("the background snapshot write of step %d crashed", self.step)
            self.crash = exc
        finally:
            self.write_s = time.monotonic() - started

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def _other_runs_copies(base: str, run_id: str) -> list[str]:
    """The directories under the fast tier's ``base`` (its run.name) that hold other runs' copies: one per run id, and
    ``base`` itself when it holds anything else (the copies of an elastictrain that kept them there)."""
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return []
    ids = [name for name in entries if len(name) == 32 and all(c in "0123456789abcdef" for c in name)]
    return ([base] if set(entries) - set(ids) else []) + [os.path.join(base, name) for name in ids if name != run_id]


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(value) for value in tree)
    return 0


def start_fresh_advice(cfg: Config) -> str:
    """How to start this run over beside its snapshots: the key that gives it an empty store (snapshot.resume=false
    is refused while the store holds any)."""
    if cfg.snapshot.url:
        return f"start fresh with snapshot.url set to an empty location (it is {cfg.snapshot.url})"
    return f"start fresh with another {'run.dir' if cfg.run.dir else 'run.name'} (snapshots go to {cfg.snapshot_url})"


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, current value)}`` for every leaf that differs (missing reads as None)."""
    old, new = _flatten(saved), _flatten(current)
    return {key: (old.get(key), new.get(key)) for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[key] = value
    return flat


def _under(key: str, prefixes: Any) -> bool:
    return any(key == prefix or key.startswith(f"{prefix}.") for prefix in prefixes)


def _warn_on_changed_hyperparameters(optimizer: torch.optim.Optimizer, saved: dict[str, Any], where: str) -> None:
    """Loading the optimizer state brings the snapshot's lr, betas, ... back: say so when this run set others."""
    differences = []
    for index, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved.get("param_groups", []))):
        for name, value in group.items():
            if name in ("params", "initial_lr") or name not in saved_group:
                continue
            # A scheduler moves lr; what the user chose is its starting value.
            before = saved_group.get("initial_lr", saved_group[name]) if name == "lr" else saved_group[name]
            if _differs(value, before):
                differences.append(f"{name} {before!r} -> {value!r}" + (f" (group {index})" if index else ""))
    if differences:
        log.warning("%s: the optimizer's hyperparameters differ from this run's (%s); the snapshot's values are "
                    "restored with its state — start fresh (another run.name) to train with the new ones",
                    where, ", ".join(differences))


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b


class LeaseKeeper:
    """Holds the store's lease for this job on rank 0 and renews it from a daemon thread.

    The token is shared by every attempt of one job (torchrun's --rdzv-id, else a token kept in
    its agent's store; the SLURM job id), so a restarted attempt takes its own lease over while
    another job is refused.
    """

    def __init__(self, store: SnapshotStore, cfg: Config, ctx: DistContext) -> None:
        self.store = store
        self.stale_after_s = cfg.snapshot.lease_stale_after_s
        self.owner = {
            "run_id": f"{cfg.run.name} ({ctx.env.launcher} {ctx.env.run_id})",
            "token": _job_token(ctx),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_unix": time.time(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: StoreLeaseError | None = None  # set when another run has taken the lease

    def start(self) -> None:
        if self.stale_after_s <= 0:
            return
        self.store.acquire_lease(self.owner, self.stale_after_s)
        self._thread = threading.Thread(target=self._renew, name="elastictrain-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        interval = max(1.0, self.stale_after_s / 4)
        while not self._stop.wait(interval):
            try:
                self.store.renew_lease()
            except StoreLeaseError as exc:  # another run took the store over: never write beside it
                self.lost = exc
                log.error("%s", exc)
                return
            except ElastictrainError as exc:  # an outage: the lease ages; the next renewal may succeed
                log.debug("lease renewal failed: %s", exc)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        try:
            self.store.release_lease()
        except ElastictrainError as exc:
            log.warning("could not release the snapshot store's lease (%s); it goes stale in %.0f s", exc, self.stale_after_s)


def _job_token(ctx: DistContext) -> str:
    if ctx.env.launcher == "torchrun" and ctx.env.run_id != TORCHRUN_DEFAULT_RUN_ID:
        # --rdzv-id names the job on every node, and outlives the store: when the node hosting the
        # workers' store is lost (etcd rendezvous), the new rank 0 hosts a new one.
        return f"torchrun {ctx.env.run_id}"
    if ctx.run_store is not None:
        # compare_set sets the key only if it is absent: the first attempt's token wins for all.
        return ctx.run_store.compare_set("lease_token", "", uuid.uuid4().hex).decode()
    if ctx.env.launcher == "slurm":
        return ctx.env.run_id  # slurm-<job id>: a requeued job keeps its id
    return uuid.uuid4().hex
