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

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import errors, failpoints
from .config import Config
from .dist import DistContext, broadcast_from_main, gather_to_main
from .errors import ElastictrainError, SnapshotError, StorageError, StorageUnavailable, StoreLeaseError
from .events import SnapshotReport
from .snapshot import (
    FORMAT_VERSION,
    MODEL_OBJECT,
    STATE_OBJECT,
    capture_rng,
    load_model_weights,
    load_object,
    restore_rng,
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
                        "train_data.len")


@dataclass(frozen=True)
class Restored:
    snapshot_id: str
    step: int
    saved_world_size: int
    duration_s: float


class Snapshotter:
    """Save and restore the model plus every Stateful in ``statefuls`` (name -> object or None)."""

    def __init__(self, cfg: Config, ctx: DistContext, model: nn.Module, statefuls: dict[str, Any],
                 train_samples: int | None = None, rank_statefuls: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        # Statefuls whose state differs per rank (a stream's position), saved as one entry per rank.
        self.rank_statefuls = rank_statefuls or {}
        self.train_samples = train_samples  # the data position counts samples: another size is another dataset
        self.ctx = ctx
        self.model = model  # the unwrapped module: its weights are the model object
        self.statefuls = statefuls
        self.store = SnapshotStore(cfg.snapshot_url, cfg.snapshot.storage_options, retry_for_s=cfg.snapshot.retry_for_s)
        self.last_committed: tuple[int, float] | None = None  # (step, unix time) of the newest committed snapshot
        self._behind_since: tuple[int, float] | None = None  # first failed snapshot while behind
        self._lease: LeaseKeeper | None = None

    @property
    def url(self) -> str:
        return self.store.url

    # -- restore ------------------------------------------------------------------------------

    def restore(self) -> Restored | None:
        """Load the newest valid snapshot on every rank; None when training starts fresh."""
        started = time.monotonic()
        found, error = None, None
        if self.ctx.is_main:
            try:
                self.store.check_writable()
                self._lease = LeaseKeeper(self.store, self.cfg, self.ctx)
                self._lease.start()
                if self.cfg.snapshot.resume:
                    found = self.store.latest_valid()
                elif self.store.list_snapshots():
                    # A fresh run writing beside another run's snapshots would mix the two.
                    raise SnapshotError(
                        f"snapshot.resume=false but {self.store.url} already holds snapshots; point snapshot.url "
                        "(or run.name) somewhere empty, or remove them — nothing was deleted"
                    )
            except ElastictrainError as exc:
                error = (type(exc).__name__, str(exc))
        found, error = broadcast_from_main((found, error), self.ctx)
        if error is not None:
            raise getattr(errors, error[0], ElastictrainError)(error[1])
        if found is None:
            return None
        manifest, objects = found
        self._load(manifest, objects)
        self.last_committed = (manifest.step, manifest.created_unix)
        saved_world_size = int(manifest.meta.get("world_size", self.ctx.world_size))
        return Restored(manifest.snapshot_id, manifest.step, saved_world_size, time.monotonic() - started)

    def _load(self, manifest: Manifest, objects: dict[str, bytes]) -> None:
        where = f"snapshot {self.store.url}/{manifest.snapshot_id}"
        for name in (MODEL_OBJECT, STATE_OBJECT):
            if name not in objects:
                raise SnapshotError(f"{where} has no {name!r} object; it was not written by elastictrain")
        weights = load_object(objects[MODEL_OBJECT], where, self.ctx.device)
        state = load_object(objects[STATE_OBJECT], where, self.ctx.device)
        if state.get("format_version") != FORMAT_VERSION:
            raise SnapshotError(
                f"{where} has format {state.get('format_version')}, this elastictrain reads format {FORMAT_VERSION}; "
                "use the elastictrain version that wrote it, or set snapshot.resume=false to start fresh"
            )
        load_model_weights(self.model, weights, where)
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
        else:
            # The data position re-shards exactly; per-rank random streams cannot, so they are
            # re-seeded from the step (the same on every restart with this world size).
            seed_rng(self.cfg.run.seed + self.ctx.rank + 1_000_003 * progress.global_step)
            log.warning(
                "%s was taken with world size %d, this run has %d: data position re-sharded from sample %d of epoch %d, "
                "RNG streams re-seeded (results will not be bitwise equal to an unbroken run)",
                where, saved_env["world_size"], self.ctx.world_size, progress.epoch_offset, progress.epoch,
            )
        if saved_env["num_threads"] != torch.get_num_threads():
            log.warning(
                "%s was taken with %d intra-op threads, this worker has %d: float results can differ in the last bits; "
                "set OMP_NUM_THREADS=%d for bitwise-identical resumes", where, saved_env["num_threads"],
                torch.get_num_threads(), saved_env["num_threads"],
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
                f"of the run; start fresh with another run.name (or an empty snapshot.url), or accept it with "
                f"snapshot.accept_changes=[{','.join(critical)}] — nothing was deleted"
            )
        log.warning("%s was made with another config; resuming with this run's: %s", where,
                    ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items()))

    # -- save ---------------------------------------------------------------------------------

    def save(self, step: int, meta: dict[str, Any]) -> SnapshotReport:
        """Commit a snapshot of this step; every rank returns the same report (or raises the same error)."""
        started = time.monotonic()
        mine = {"rng": capture_rng(self.ctx.device), **{n: c.state_dict() for n, c in self.rank_statefuls.items()}}
        rank_states = gather_to_main(mine, self.ctx)
        outcome = self._commit(step, rank_states, meta, started) if self.ctx.is_main else None
        # The one point where all ranks learn the outcome together: nobody trains on while
        # rank 0 is about to stop, and nobody waits on a collective for a rank that left.
        committed, size, error, stop = broadcast_from_main(outcome, self.ctx)
        if stop:
            raise StorageError(error)
        return SnapshotReport(step, committed, time.monotonic() - started, size, error)

    def _commit(self, step: int, rank_states: list[dict], meta: dict[str, Any], started: float) -> tuple:
        state = self._state_dict(rank_states)

        def write_state(fileobj: Any) -> None:
            failpoints.hit("snapshot-write", step)  # tests: kill rank 0 after model.pt, before state.pt
            torch.save(state, fileobj)

        writers = {MODEL_OBJECT: writer_for(self.model.state_dict()), STATE_OBJECT: write_state}
        if self._lease is not None and self._lease.lost is not None:
            return False, 0, f"snapshot at step {step} not written: {self._lease.lost}", True
        try:
            manifest = self.store.commit(step, writers, {**meta, "format_version": FORMAT_VERSION})
        except StorageError as exc:
            stop = not isinstance(exc, StorageUnavailable) and self.cfg.snapshot.on_error == "stop"
            return False, 0, self._fell_behind(step, exc, stop), stop
        self.last_committed = (step, manifest.created_unix)
        try:
            pruned = self.store.prune(self.cfg.snapshot.keep_last)
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
        if self._lease is not None:
            self._lease.stop()
            self._lease = None


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
