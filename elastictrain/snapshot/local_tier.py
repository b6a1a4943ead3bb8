"""The node-local fast tier (``snapshot.local``): each node's copies of the run, written by the node's writer.

Every node's local rank 0 keeps its own full copy (the state is the same on every rank under DDP, and every rank's
RNG is gathered to each writer); under fsdp every rank writes its shards into its node's copy and its peer node's
(``fast_shards.py``). A failed fast copy is a warning, never a stop. The copies live under the run's id
(``join_run``), so a run never restores another run's copies; a surviving rank can commit one after a peer died
(``save_survivor``, with no collective).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Any

from elastictrain.core import failpoints
from elastictrain.core.config import Config
from elastictrain.core.errors import ConfigError, ElastictrainError, StorageError
from elastictrain.core.events import SnapshotReport, Tier
from elastictrain.core.rng import capture_rng
from elastictrain.dist.collectives import CarriedError, all_gather, carried, raise_carried
from elastictrain.dist.group import DistContext
from elastictrain.snapshot.background_write import CommitOutcome
from elastictrain.snapshot.fast_shards import FastShards
from elastictrain.snapshot.format import tensors_in
from elastictrain.snapshot.snapshotter import Snapshotter, TierSettings
from elastictrain.storage.manifest import Verified
from elastictrain.storage.snapshot_store import SnapshotStore

log = logging.getLogger("elastictrain")


class LocalTier(Snapshotter):
    """``snapshot.local``: no storage options, no on_error (a fast copy never stops the run), a short retry."""

    tier = Tier.LOCAL

    @staticmethod
    def settings_from(cfg: Config, ctx: DistContext) -> TierSettings:
        assert cfg.local_snapshot_url is not None  # the fast tier exists only with snapshot.local.url
        local, fsdp = cfg.snapshot.local, cfg.dist.strategy == "fsdp"
        return TierSettings(
            url=cfg.local_snapshot_url,
            storage_options={},
            retry_for_s=min(2.0, cfg.snapshot.durable.retry_for_s),
            keep_last=local.keep_last,
            on_error="continue",
            is_writer=ctx.env.local_rank == 0,
            asynchronous=local.async_write,
            # fsdp: no recycling (fast_shards.py says why)
            recycle_keep_last=0 if fsdp else local.keep_last,
            url_key="snapshot.local.url",
        )

    def _attach(self) -> None:
        self._size_checked = False
        self._run_name_dir: str | None = None  # the fast tier's directory of run.name, once joined to the run
        self.fast_shards = FastShards(self.sharded, self.ctx) if self.sharded is not None else None

    def join_run(self, run_id: str) -> str | None:
        """The fast tier, on every rank: keep this node's copies under the run's id (``SnapshotStore.run_id``).

        A copy in another id's directory belongs to another run (the same run.name with another or
        an emptied durable store): the node's writer skips it with one line and leaves it alone.
        Returns why the tier cannot be used here (its directory is not writable), or None.
        """
        base = self._run_name_dir = self.cfg.local_snapshot_url
        assert base is not None  # the fast tier exists only with snapshot.local.url
        old = self.store
        self.store = SnapshotStore(
            os.path.join(base, run_id),
            retry_for_s=old.retry_for_s,
            recycle_keep_last=old.recycle_keep_last,
            url_key=old.url_key,
        )
        if not self.is_writer:
            return None
        try:
            self.store.check_writable()
        except StorageError as exc:
            return (
                f"snapshot.local.url={self.cfg.snapshot.local.url} cannot be used on this node: {exc} (or set "
                "snapshot.local.url=null to train without the fast tier) — nothing saved is lost"
            )
        for other in _other_runs_copies(base, run_id):
            log.warning(
                "skipping the node-local copies in %s: they belong to another run of this run.name (not to the "
                "durable store %s) and are never restored here; remove that directory to give its memory back",
                other,
                self.cfg.durable_snapshot_url,
            )
        return None

    def newest_local(self) -> tuple[Verified | None, Verified | None]:
        """This node's newest fast copy that verifies: (it, None), or (None, it) where it leaves ranks' state in their
        nodes' slots (a survivor copy of a job across nodes: ``slots.py``; ``newest_below`` reads the copy below
        it if restoring passes it over). Read on each node's writer, and on every rank when the job runs on one node
        (``restore.py``: then nothing is sent)."""
        if not self.is_writer:
            # tests: the copy changes after the node's writer read it (no step yet: the attempt's restart count instead)
            failpoints.hit("node-copy-read", self.ctx.env.restart_count)
        found = self.newest_below(None)
        return (None, found) if found is not None and found.manifest.meta.get("in_slots") else (found, None)

    def newest_below(self, step: int | None) -> Verified | None:
        """This node's newest fast copy below ``step`` (None: any) that verifies, or None."""
        try:
            return self.store.latest_valid(below=step)
        except ElastictrainError as exc:  # nothing usable here; another node or the durable store may have one
            log.warning("node-local snapshots at %s are not usable: %s", self.store.url, exc)
            return None

    def discard(self, step: int) -> None:
        """Remove this node's copy of ``step`` (a survivor copy that needs other nodes' slots, once restoring saw it)."""
        try:
            self.store.clear_prefix(step)
        except StorageError as exc:
            log.warning("could not remove the node-local copy of step %d: %s", step, exc)

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
                root = os.path.dirname(
                    self._run_name_dir
                )  # snapshot.local.url itself, once empty (never a mount point)
                if not os.path.ismount(root):
                    with contextlib.suppress(OSError):
                        os.rmdir(root)
        except OSError as exc:
            log.warning("could not remove the node-local snapshots at %s: %s", self.store.url, exc)

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any]) -> SnapshotReport | None:
        """Each node's writer keeps its own copy; the ranks agree only that every copy fits its node.

        One exchange does both: every rank's RNG (and per-rank state) travels to every writer with
        the writers' refusals (the previous copy failed for good, or the first does not fit).
        """
        started = time.monotonic()
        mine = {"rng": capture_rng(self.ctx.device), **self.rank_state()}
        refused: CarriedError | None = None
        if self.fast_shards is not None:
            self.fast_shards.measure()  # every rank, at the first copy: the ranks' nodes and shard sizes (a collective)
        if self.is_writer:
            self._writes.join()  # the previous fast copy: a crash of its writer stops every rank now
            if self._writes.failed is not None:
                refused = carried(StorageError(self._writes.failed))
            elif not self._size_checked:
                # Only before the run's first copy on this node: a tier that held one fits, and one full for now
                # (another tenant of the node's memory) at a restart fails its copies with a warning, as any failed
                # fast copy does, instead of stopping the run with a config error no restart can fix.
                fits = None if self._holds_a_copy() else self._check_fits([mine] * self.ctx.world_size)
                refused = None if fits is None else carried(ConfigError(fits))
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

    def _save_node_copy(
        self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float
    ) -> SnapshotReport | None:
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

    def save_survivor(
        self, step: int, rank_states: list[dict], meta: dict[str, Any], prune: bool = True
    ) -> SnapshotReport | None:
        """The fast tier, on the node's lowest surviving rank after a peer was lost: commit ``step`` from the live
        model and every rank's state (``survivor.py``), with no collective (the group is broken). None when the
        tier already holds a committed copy of this step. ``prune``: False keeps the copies before it."""
        started = time.monotonic()
        self._writes.join()  # this rank's own copy in flight first: one writer at a time
        if any(s.step == step and s.manifest is not None for s in self.store.list_snapshots()):
            return None
        outcome = self._commit(step, self.model.state_dict(), self._state_dict(rank_states), meta, started, prune=prune)
        return outcome.report(step, time.monotonic() - started, self.tier)

    def _holds_a_copy(self) -> bool:
        try:
            return any(snapshot.manifest is not None for snapshot in self.store.list_snapshots())
        except StorageError:  # unreadable: the size check decides, as before any copy
            return False

    def _check_fits(self, rank_states: list[dict]) -> str | None:
        """The fast tier must not fill the node's memory: its size is known now, before the first write."""
        model_bytes = (
            self.fast_shards.node_bytes if self.fast_shards is not None else _tensor_bytes(self.model.state_dict())
        )
        state_bytes = model_bytes + _tensor_bytes(self._state_dict(rank_states))
        needed = state_bytes * (self.keep_last + 1)  # the kept copies and the one being written
        path = self.store.root
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        free = shutil.disk_usage(path).free
        if needed <= free:
            return None
        return (
            f"the node-local snapshot tier {self.store.url} needs about {needed / 1e6:.0f} MB "
            f"({self.keep_last} kept + 1 being written, {state_bytes / 1e6:.0f} MB each) but {path} has "
            f"{free / 1e6:.0f} MB free; lower snapshot.local.keep_last, point snapshot.local.url at a larger "
            "node-local path, or set it to null — the durable snapshots are untouched"
        )


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
