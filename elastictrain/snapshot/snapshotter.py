"""Taking and restoring snapshots: from live objects to committed bytes and back, on every rank.

``Snapshotter`` owns the whole path. Saving gathers every rank's RNG state on rank 0, which
streams the model and every registered Stateful into the store (manifest last), prunes, and
then tells every rank the outcome in one broadcast, so all ranks agree at once whether the
snapshot exists and whether training goes on. Restoring has rank 0 read and verify the newest
valid snapshot and hand its bytes to every rank, so every rank loads the very same one
(``restore.py``, after the checks of ``resume_checks.py``).

A store that cannot be reached is retried by the store (with backoff, ``snapshot.durable.retry_for_s``)
and then given up *for this snapshot only*: training goes on, one warning says since when
snapshots are behind, and the next interval tries again. A write that fails for good (disk
full, permission denied) stops the run cleanly by default (``snapshot.durable.on_error``).

Its helpers, each a module: ``background_write.py`` (``snapshot.durable.async_write``: one write in
flight on a thread), ``lease_keeper.py`` (rank 0 holds the durable store's lease) and
``sharded_writes.py`` (``dist.strategy=fsdp``: every rank writes its shards). It imports
nothing of the loop: the loop hands it the objects to save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Any

import torch
from torch import nn

from elastictrain.core import failpoints
from elastictrain.core.config import Config
from elastictrain.core.errors import ElastictrainError, StorageError, StorageUnavailable
from elastictrain.core.events import SnapshotReport
from elastictrain.core.rng import capture_rng
from elastictrain.dist.collectives import all_gather, broadcast_from_main, gather_to_main, main_acts, raise_carried
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.background_write import PENDING, BackgroundWrites, CommitOutcome
from elastictrain.snapshot.fast_shards import FastShards
from elastictrain.snapshot.format import (
    FORMAT_VERSION,
    MODEL_OBJECT,
    STATE_OBJECT,
    save_object,
    tensors_in,
    writer_for,
)
from elastictrain.snapshot.lease_keeper import LeaseKeeper
from elastictrain.snapshot.restore import Restored, restore_newest
from elastictrain.snapshot.sharded import SHARDED, ShardedState
from elastictrain.snapshot.sharded_writes import ShardedWrites
from elastictrain.snapshot.staging import Stager
from elastictrain.storage.commit import Writer
from elastictrain.storage.manifest import Manifest
from elastictrain.storage.snapshot_store import SnapshotStore

log = logging.getLogger("elastictrain")


def store_key(cfg: Config, tier: str) -> str:
    """The key a message about a tier's store tells the user to change: the one that set its URL (the durable store
    defaults to <run.dir>/snapshots: a run.dir that cannot be written is fixed in run.dir)."""
    if tier == "local":
        return "snapshot.local.url"
    return "snapshot.durable.url" if cfg.snapshot.durable.url else "run.dir"


class Snapshotter:
    """Save and restore the model plus every Stateful in ``statefuls`` (name -> object or None)."""

    def __init__(self, cfg: Config, ctx: DistContext, model: nn.Module, statefuls: dict[str, Any],
                 train_samples: int | None = None, rank_statefuls: dict[str, Any] | None = None,
                 tier: str = "durable") -> None:
        self.cfg = cfg
        # "durable": rank 0 writes snapshot.durable.url and every rank agrees on the outcome. "local": the
        # fast tier, where each node's local rank 0 keeps its own full copy (the state is the same
        # on every rank under DDP, and every rank's RNG is gathered to each writer); a failed fast
        # copy is a warning, never a stop.
        self.tier = tier
        if tier == "durable":
            durable = cfg.snapshot.durable
            url, options, retry_for_s = cfg.durable_snapshot_url, durable.storage_options, durable.retry_for_s
            self.keep_last, self.on_error, self.is_writer = durable.keep_last, durable.on_error, ctx.is_main
        else:  # no storage options, no on_error (a fast copy never stops the run), a short retry: config.LocalTierConfig
            assert cfg.local_snapshot_url is not None  # the fast tier exists only with snapshot.local.url
            url, options, retry_for_s = cfg.local_snapshot_url, {}, min(2.0, cfg.snapshot.durable.retry_for_s)
            self.keep_last, self.on_error, self.is_writer = cfg.snapshot.local.keep_last, "continue", ctx.env.local_rank == 0
        self._size_checked = False
        self._run_name_dir: str | None = None  # the fast tier's directory of run.name, once joined to the run (join_run)
        # Statefuls whose state differs per rank (a stream's position), saved as one entry per rank.
        self.rank_statefuls = rank_statefuls or {}
        self.train_samples = train_samples  # the data position counts samples: another size is another dataset
        self.ctx = ctx
        self.model = model  # the unwrapped module: its weights are the model object
        self.statefuls = statefuls
        fsdp = cfg.dist.strategy == "fsdp"
        self.store = SnapshotStore(url, options, retry_for_s=retry_for_s,  # fsdp: no recycling (fast_shards.py says why)
                                   recycle_keep_last=self.keep_last if tier == "local" and not fsdp else 0,
                                   url_key=store_key(cfg, tier))
        self.last_committed: tuple[int, float] | None = None  # (step, unix time) of the newest committed snapshot
        self._behind_since: tuple[int, float] | None = None  # first failed snapshot while behind
        self._lease: LeaseKeeper | None = None
        # snapshot.durable.async_write, snapshot.local.async_write: stage into reused buffers, write in a thread, one at a time.
        self.asynchronous = (cfg.snapshot.durable if tier == "durable" else cfg.snapshot.local).async_write
        self._stager = Stager()
        self._writes = BackgroundWrites(tier)  # fsdp: on every rank, each writing its shards
        # dist.strategy=fsdp: the model and optimizers are every rank's own shards, written by every rank (sharded.py);
        # into the durable store (sharded_writes.py), or into each node's fast tier and its peer node's (fast_shards.py).
        self.sharded = ShardedState(model, [c for c in statefuls.values() if isinstance(c, torch.optim.Optimizer)],
                                    options) if fsdp else None
        self.shard_writes = ShardedWrites(self.sharded, self.store, ctx) if self.sharded is not None and tier == "durable" else None
        self.fast_shards = FastShards(self.sharded, ctx) if self.sharded is not None and tier == "local" else None

    @property
    def url(self) -> str:
        return self.store.url

    # -- restore ------------------------------------------------------------------------------

    def restore(self, fast: Snapshotter | None = None) -> Restored | None:
        """Load the newest valid snapshot on every rank; None when training starts fresh.

        With a fast tier, every node offers the newest copy it holds and verifies; the durable
        store is read only when it holds a newer one (``restore.py``).
        """
        started = time.monotonic()  # the restore's duration counts opening the store too
        self._run_id = self._open_store()
        return restore_newest(self, fast, self._run_id, started)

    def roll_back(self, fast: Snapshotter | None, keep: tuple[str, ...]) -> Restored | None:
        """ROLLBACK: ``restore`` again in this process, the store open, the objects in ``keep`` left alone."""
        return restore_newest(self, fast, self._run_id, time.monotonic(), keep)

    def _open_store(self) -> str:
        """Rank 0 checks that the durable store is writable, takes its lease and reads the run's id; every rank
        returns the id, or raises rank 0's error."""
        def open_on_main() -> str:
            self.store.check_writable()
            self._lease = LeaseKeeper(self.store, self.cfg, self.ctx)
            self._lease.start()
            return self.store.run_id()

        return main_acts(open_on_main, self.ctx)

    def join_run(self, run_id: str) -> str | None:
        """The fast tier, on every rank: keep this node's copies under the run's id (``SnapshotStore.run_id``).

        A copy in another id's directory belongs to another run (the same run.name with another or
        an emptied durable store): the node's writer skips it with one line and leaves it alone.
        Returns why the tier cannot be used here (its directory is not writable), or None.
        """
        base = self._run_name_dir = self.cfg.local_snapshot_url
        assert base is not None  # the fast tier exists only with snapshot.local.url
        old = self.store
        self.store = SnapshotStore(os.path.join(base, run_id), retry_for_s=old.retry_for_s,
                                   recycle_keep_last=old.recycle_keep_last, url_key=old.url_key)
        if not self.is_writer:
            return None
        try:
            self.store.check_writable()
        except StorageError as exc:
            return (f"snapshot.local.url={self.cfg.snapshot.local.url} cannot be used on this node: {exc} (or set "
                    "snapshot.local.url=null to train without the fast tier) — nothing saved is lost")
        for other in _other_runs_copies(base, run_id):
            log.warning("skipping the node-local copies in %s: they belong to another run of this run.name (not to the "
                        "durable store %s) and are never restored here; remove that directory to give its memory back",
                        other, self.cfg.durable_snapshot_url)
        return None

    def newest_local(self) -> tuple[Manifest, dict[str, bytes]] | None:
        """This node's newest fast copy that verifies, or None. Read on each node's writer, and on every rank when the
        job runs on one node (``restore.py``: then nothing is sent)."""
        if not self.is_writer:
            # tests: the copy changes after the node's writer read it (no step yet: the attempt's restart count instead)
            failpoints.hit("node-copy-read", self.ctx.env.restart_count)
        try:
            return self.store.latest_valid()
        except ElastictrainError as exc:  # nothing usable here; another node or the durable store may have one
            log.warning("node-local snapshots at %s are not usable: %s", self.store.url, exc)
            return None

    def clear(self) -> None:
        """Remove this node's fast copies (at DONE, PREEMPTED, or when a run starts fresh)."""
        if not self.is_writer:
            return
        self._writes.join()
        try:
            if self.store.fs.exists(self.store.root):
                self.store.fs.rm(self.store.root, recursive=True)
            if self._run_name_dir is not None:
                with contextlib.suppress(OSError):  # the run.name's directory, once no run's copies are left in it
                    os.rmdir(self._run_name_dir)
                root = os.path.dirname(self._run_name_dir)  # snapshot.local.url itself, once empty (never a mount point)
                if not os.path.ismount(root):
                    with contextlib.suppress(OSError):
                        os.rmdir(root)
        except OSError as exc:
            log.warning("could not remove the node-local snapshots at %s: %s", self.store.url, exc)

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any]) -> SnapshotReport | None:
        """Take a snapshot of this step on every rank; every rank returns the same report or raises the same error.

        Written in the background (``snapshot.durable.async_write``), it returns None: the report comes
        from ``poll`` once the write is done, and ``flush`` waits for it.
        """
        started = time.monotonic()
        mine = {"rng": capture_rng(self.ctx.device), **self.rank_state()}
        if self.tier == "local":
            return self._save_local(step, mine, meta, started)
        shards_async = self.sharded is not None and self.asynchronous
        written = self.shard_writes.write(step) if self.shard_writes is not None and not shards_async else None
        rank_states = gather_to_main(mine, self.ctx)
        if shards_async:  # every rank: the write in flight finished (one at a time), this rank's shards staged
            assert self.shard_writes is not None and self.sharded is not None
            self.shard_writes.side_group()
            self._writes.join()
            shards = self.sharded.stage()
        outcome = None
        if rank_states is not None:  # rank 0
            outcome = self._start_write(step, rank_states, meta, started, shards if shards_async else None) \
                if self.asynchronous else self._commit(step, None if written is not None else self.model.state_dict(),
                                                       self._state_dict(rank_states), meta, started, written)
        # The one point where all ranks learn the outcome together: nobody trains on while
        # rank 0 is about to stop, and nobody waits on a collective for a rank that left.
        outcome = broadcast_from_main(outcome, self.ctx)
        if outcome.stop:
            raise StorageError(outcome.error)
        if shards_async and not self.ctx.is_main:  # rank 0 started its write: the others write their shards alongside
            self._writes.start(step, 0.0, lambda: self._commit_behind(step, shards))
        if outcome.committed and not self.ctx.is_main:
            self.last_committed = (step, time.time())  # every rank knows the newest committed step
        if self.asynchronous and outcome.error is None:
            return None
        return outcome.report(step, time.monotonic() - started, self.tier)

    def _save_local(self, step: int, mine: dict, meta: dict[str, Any], started: float) -> SnapshotReport | None:
        """Each node's writer keeps its own copy; the ranks agree only that every copy fits its node.

        One exchange does both: every rank's RNG (and per-rank state) travels to every writer with
        the writers' refusals (the previous copy failed for good, or the first does not fit).
        """
        refused = None
        if self.fast_shards is not None:
            self.fast_shards.measure()  # every rank, at the first copy: the ranks' nodes and shard sizes (a collective)
        if self.is_writer:
            self._writes.join()  # the previous fast copy: a crash of its writer stops every rank now
            if self._writes.failed is not None:
                refused = ("StorageError", self._writes.failed)
            elif not self._size_checked:
                # Only before the run's first copy on this node: a tier that held one fits, and one full for now
                # (another tenant of the node's memory) at a restart fails its copies with a warning, as any failed
                # fast copy does, instead of stopping the run with a config error no restart can fix.
                fits = None if self._holds_a_copy() else self._check_fits([mine] * self.ctx.world_size)
                refused = None if fits is None else ("ConfigError", fits)
                self._size_checked = True
        exchanged = all_gather((mine, refused), self.ctx)
        rank_states = [ranks for ranks, _ in exchanged]
        refusals = [r for _, r in exchanged if r is not None]
        if refusals:
            if self._writes.crash is not None:
                raise self._writes.crash  # a bug in the writer keeps its traceback on its rank
            raise_carried(refusals[0])
        if self.fast_shards is not None:
            return self._save_node_copy(step, rank_states, meta, started)
        if not self.is_writer:
            return None
        if self.asynchronous:
            self._start_write(step, rank_states, meta, started)
            return None
        outcome = self._commit(step, self.model.state_dict(), self._state_dict(rank_states), meta, started)
        return outcome.report(step, time.monotonic() - started, self.tier)

    def _save_node_copy(self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float) -> SnapshotReport | None:
        """fsdp: every rank writes its shards into its node's copy and its peer node's (``fast_shards.py``); each node's
        writer commits what its node holds, or warns why it cannot."""
        assert self.fast_shards is not None  # fsdp's fast tier
        copy = self.fast_shards.write(self.store, step, self.is_writer)
        if not self.is_writer:
            return None
        if copy.error is not None:
            error = self._fell_behind(step, StorageError(copy.error), stop=False)
            return CommitOutcome(error=error).report(step, time.monotonic() - started, self.tier)
        outcome = self._commit(step, None, self._state_dict(rank_states), {**meta, **copy.meta}, started, copy.written)
        return outcome.report(step, time.monotonic() - started, self.tier)

    def save_survivor(self, step: int, rank_states: list[dict], meta: dict[str, Any]) -> SnapshotReport | None:
        """The fast tier, on the node's lowest surviving rank after a peer was lost: commit ``step`` from the live
        model and every rank's state (``survivor.py``), with no collective (the group is broken). None when the
        tier already holds a committed copy of this step."""
        started = time.monotonic()
        self._writes.join()  # this rank's own copy in flight first: one writer at a time
        if any(s.step == step and s.manifest is not None for s in self.store.list_snapshots()):
            return None
        outcome = self._commit(step, self.model.state_dict(), self._state_dict(rank_states), meta, started)
        return outcome.report(step, time.monotonic() - started, self.tier)

    def rank_state(self) -> dict[str, Any]:
        """This rank's share of a snapshot besides its RNG: its streams' positions, its metric sums since the last reduce."""
        return {name: component.state_dict() for name, component in self.rank_statefuls.items()}

    def rank_state_now(self) -> dict[str, Any] | None:
        """``rank_state`` at every step (survivor copies): None where reading it would wait for the device."""
        state = {name: component.peek() if hasattr(component, "peek") else component.state_dict()
                 for name, component in self.rank_statefuls.items()}
        return None if any(value is None for value in state.values()) else state

    def _holds_a_copy(self) -> bool:
        try:
            return any(snapshot.manifest is not None for snapshot in self.store.list_snapshots())
        except StorageError:  # unreadable: the size check decides, as before any copy
            return False

    def _check_fits(self, rank_states: list[dict]) -> str | None:
        """The fast tier must not fill the node's memory: its size is known now, before the first write."""
        model_bytes = self.fast_shards.node_bytes if self.fast_shards is not None else _tensor_bytes(self.model.state_dict())
        state_bytes = model_bytes + _tensor_bytes(self._state_dict(rank_states))
        needed = state_bytes * (self.keep_last + 1)  # the kept copies and the one being written
        path = self.store.root
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        free = shutil.disk_usage(path).free
        if needed <= free:
            return None
        return (f"the node-local snapshot tier {self.store.url} needs about {needed / 1e6:.0f} MB "
                f"({self.keep_last} kept + 1 being written, {state_bytes / 1e6:.0f} MB each) but {path} has "
                f"{free / 1e6:.0f} MB free; lower snapshot.local.keep_last, point snapshot.local.url at a larger "
                "node-local path, or set it to null — the durable snapshots are untouched")

    # -- asynchronous writes: stage at the step boundary, write in the background ----------

    def _start_write(self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float,
                     shards: dict | None = None) -> CommitOutcome:
        """Rank 0: wait for the write in flight, stage this step's state into reused buffers, write it in a thread.
        fsdp (``shards``: this rank's, staged): every rank writes its shards in a thread, rank 0 commits after them."""
        self._writes.join()  # at most one in flight: staging reuses the buffers the last one wrote from
        if self._writes.failed is not None:
            return CommitOutcome(error=self._writes.failed, stop=True)
        if self._lease is not None and self._lease.lost is not None:
            return CommitOutcome(error=f"snapshot at step {step} not written: {self._lease.lost}", stop=True)
        if shards is not None:
            state = self._stager.stage({STATE_OBJECT: self._state_dict(rank_states)})[STATE_OBJECT]
            blocked_s = time.monotonic() - started
            self._writes.start(step, blocked_s, lambda: self._commit_behind(step, shards, state, meta))
            return PENDING
        staged = self._stager.stage({MODEL_OBJECT: self.model.state_dict(), STATE_OBJECT: self._state_dict(rank_states)})
        blocked_s = time.monotonic() - started
        self._writes.start(
            step, blocked_s, lambda: self._commit(step, staged[MODEL_OBJECT], staged[STATE_OBJECT], meta, time.monotonic()))
        return PENDING

    def _commit_behind(self, step: int, shards: dict, state: dict | None = None, meta: dict | None = None) -> CommitOutcome:
        """fsdp with async_write, every rank's writer thread: its staged shards written (``sharded_writes.py``); rank 0
        commits the manifest last, once every rank's shards are written."""
        assert self.shard_writes is not None  # fsdp's durable tier
        written, error = self.shard_writes.write_behind(step, shards)
        if not self.ctx.is_main:
            return PENDING  # rank 0 reports the outcome
        if error is not None:
            stop = self.on_error == "stop"
            return CommitOutcome(error=self._fell_behind(step, StorageError(error), stop), stop=stop)
        assert state is not None and meta is not None  # rank 0 passes them
        return self._commit(step, None, state, meta, time.monotonic(), written)

    def poll(self) -> list[SnapshotReport]:
        """Rank 0, between steps: the reports of background writes finished since the last poll."""
        return self._writes.poll()

    def finish_writes(self) -> list[SnapshotReport]:
        """This process's write in flight, finished, and the reports not yet polled (a fast tier's, before a rollback)."""
        self._writes.join()
        return self._writes.poll()

    @property
    def write_failed(self) -> bool:
        """Rank 0: a background write failed for good (or crashed); the ranks must stop at the next vote."""
        return self._writes.failed is not None

    def raise_write_failure(self) -> None:
        """Every rank, once the vote agreed that rank 0's background write failed: stop with one line."""
        if self._writes.crash is not None:
            raise self._writes.crash  # a bug in the writer keeps its traceback
        raise StorageError(self._writes.failed or "rank 0's background snapshot write failed for good (its log says why); "
                           "the next launch resumes from the newest committed snapshot")

    def flush(self) -> list[SnapshotReport]:
        """Every rank, before DONE and PREEMPTED: wait for the background write and agree on its outcome."""
        if not self.asynchronous:
            return []
        outcome = None
        if self.ctx.is_main:
            self._writes.join()
            outcome = (self.poll(), self._writes.failed)
        elif self.sharded is not None:  # this rank's shards written (rank 0's commit waits for them)
            self._writes.join()
            self._writes.poll()
        reports, failed = broadcast_from_main(outcome, self.ctx)
        if failed is not None:
            self._writes.failed = failed
            self.raise_write_failure()
        committed = [report.step for report in reports if report.committed]
        if committed and not self.ctx.is_main:
            self.last_committed = (committed[-1], time.time())
        return reports

    # -- the commit itself (rank 0) -----------------------------------------------------------

    def _commit(self, step: int, model_state: dict[str, Any] | None, state: dict[str, Any], meta: dict[str, Any],
                started: float, written: dict | None = None) -> CommitOutcome:
        def write_state(fileobj: Any) -> None:
            failpoints.hit("snapshot-write", step)  # tests: kill rank 0 after model.pt, before state.pt
            save_object(state, fileobj)  # torch.save without the zip CRC-32: the store checksums every byte

        writers: dict[str, Writer] = {STATE_OBJECT: write_state}
        if model_state is not None:  # None: the ranks wrote the model's shards (``written``)
            writers[MODEL_OBJECT] = writer_for(model_state)
        else:
            meta = {**meta, "sharded": SHARDED}
        if self._lease is not None and self._lease.lost is not None:
            return CommitOutcome(error=f"snapshot at step {step} not written: {self._lease.lost}", stop=True)
        try:
            manifest = self.store.commit(step, writers, {**meta, "format_version": FORMAT_VERSION}, written)
        except StorageError as exc:
            stop = not isinstance(exc, StorageUnavailable) and self.on_error == "stop"
            return CommitOutcome(error=self._fell_behind(step, exc, stop), stop=stop)
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
        return CommitOutcome(committed=True, size_bytes=size)

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
            return (f"snapshot at step {step} failed: {exc}; stopping (snapshot.durable.on_error=stop); {last}; "
                    "the next launch resumes from it")
        log.warning("snapshot at step %d not committed (%s); snapshots are behind since step %d: %s; training goes on "
                    "and the next snapshot interval tries again", step, exc, self._behind_since[0], last)
        return str(exc)

    def _state_dict(self, rank_states: list[dict]) -> dict[str, Any]:
        """Everything but the model weights; the model is its own payload object."""
        return {
            "format_version": FORMAT_VERSION,
            **{name: (c.state_dict() if c is not None else None) for name, c in self.statefuls.items()
               if not (self.sharded is not None and isinstance(c, torch.optim.Optimizer))},  # fsdp: in the shards
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
        # Leaving for any reason: a snapshot half written would be lost.
        self._writes.abandon(timeout_s=max(60.0, 3 * self.cfg.snapshot.durable.retry_for_s))
        if self._lease is not None:
            self._lease.stop()
            self._lease = None


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
    return sum(t.numel() * t.element_size() for t in tensors_in(tree))
