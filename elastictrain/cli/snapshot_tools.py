"""What ``elastictrain snapshots ...`` and ``elastictrain plot`` do with the snapshots under a URL.

Every command builds one plain document (what ``--json`` prints) and a ``render_*`` function of
``snapshot_text.py`` turns it into text for an 80-column terminal, so the two never say different
things. Listing, verifying and pruning touch only storage; torch is imported only where tensors are
loaded (show, export, plot), so the cheap commands start fast on a login node.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from elastictrain.core.errors import ElastictrainError, SnapshotError, StorageError, one_line
from elastictrain.observe.plots import attempt_markers, write_plots
from elastictrain.storage.manifest import MANIFEST_NAME, Manifest, SnapshotListing
from elastictrain.storage.mapped import ObjectData
from elastictrain.storage.snapshot_store import SnapshotStore


def open_store(url: str, storage_options: dict[str, Any]) -> tuple[SnapshotStore, list[SnapshotListing]]:
    """The store at `url` and its step-* prefixes; a missing location or an empty one is an error."""
    store = SnapshotStore(url, storage_options)
    try:
        listings = store.list_snapshots()
        exists = bool(listings) or store.fs.exists(store.root)
    except ElastictrainError:
        raise
    except Exception as exc:  # e.g. botocore's NoCredentialsError is no OSError; the fix is the user's either way
        reason = one_line(exc, kind=True)
        raise StorageError(
            f"cannot list {url} ({reason}); check the URL, --storage-option and AWS_* credentials"
        ) from None
    if not exists:
        raise StorageError(f"no such location: {url}")
    if not listings:
        raise SnapshotError(f"no snapshots under {url} (no step-* prefix){_run_dir_hint(store, url)}")
    return store, listings


def _run_dir_hint(store: SnapshotStore, url: str) -> str:
    """A run directory (``run.dir``) keeps its snapshots in ``snapshots/``: name it when that is where they are."""
    nested = f"{url.rstrip('/')}/snapshots"
    try:
        found = SnapshotStore(nested, store.client.options).list_snapshots()
    except Exception:  # noqa: BLE001 - only a hint: without it the error line still stands
        return ""
    return f"; {nested} has {len(found)}: pass that URL" if found else ""


# -- list -------------------------------------------------------------------------------------


def list_document(store: SnapshotStore, listings: list[SnapshotListing]) -> dict[str, Any]:
    """One row per step-* prefix, checked cheaply: manifest present and every object's size (no checksum)."""
    rows = []
    for listing in listings:
        sizes = _object_sizes(store, listing.snapshot_id)
        manifest = listing.manifest
        problem = listing.problem or _size_problem(manifest, sizes)
        rows.append(
            {
                "snapshot_id": listing.snapshot_id,
                "step": listing.step,
                "epoch": manifest.meta.get("epoch") if manifest else None,
                "world_size": manifest.meta.get("world_size") if manifest else None,
                "created_unix": manifest.created_unix if manifest else None,
                "created": _iso(manifest.created_unix) if manifest else None,
                "size_bytes": sum(sizes.values()),
                "sizes_ok": problem is None,
                "problem": problem,
            }
        )
    return {"url": store.url, "checked": "manifest and object sizes", "snapshots": rows}


def _object_sizes(store: SnapshotStore, snapshot_id: str) -> dict[str, int]:
    prefix = f"{store.root.rstrip('/')}/{snapshot_id}"
    try:
        entries = store.fs.ls(prefix, detail=True)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise StorageError(f"cannot list {store.url}/{snapshot_id} ({exc})") from exc
    sizes = {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
        for entry in entries
        if entry.get("type") == "file"
    }
    sizes.pop(MANIFEST_NAME, None)  # sizes everywhere are the payload's, as the training log reports them
    return sizes


def _size_problem(manifest: Manifest | None, sizes: dict[str, int]) -> str | None:
    if manifest is None:
        return None
    for name, entry in sorted(manifest.objects.items()):
        if name not in sizes:
            return f"object '{name}' is missing"
        if sizes[name] != entry.size:
            return f"object '{name}' is {sizes[name]} bytes, the manifest says {entry.size}"
    return None


# -- verify -----------------------------------------------------------------------------------


def verify_document(store: SnapshotStore, listings: list[SnapshotListing]) -> dict[str, Any]:
    """Read every object of every snapshot and check its size and checksum against the manifest."""
    rows = []
    for listing in listings:
        row: dict[str, Any]
        try:
            manifest, payload = store.read_verified(listing.snapshot_id)
            row = {
                "valid": True,
                "problem": None,
                "objects": len(payload),
                "size_bytes": sum(len(data) for data in payload.values()),
            }
        except SnapshotError as exc:
            row = {"valid": False, "problem": str(exc), "objects": None, "size_bytes": None}
        rows.append({"snapshot_id": listing.snapshot_id, "step": listing.step, **row})
    newest = rows[-1]
    valid_steps = [row["step"] for row in rows if row["valid"]]
    return {
        "url": store.url,
        "snapshots": rows,
        "newest_step": newest["step"],
        "newest_valid": newest["valid"],
        "newest_valid_step": valid_steps[-1] if valid_steps else None,
        "invalid_steps": [row["step"] for row in rows if not row["valid"]],
    }


# -- show, export, plot: these load tensors ---------------------------------------------------


def select(
    store: SnapshotStore, listings: list[SnapshotListing], step: int | None
) -> tuple[Manifest, dict[str, ObjectData]]:
    """The verified snapshot at `step`, or the newest that verifies; SnapshotError if there is none."""
    if step is None:
        try:
            found = store.latest_valid()
        except SnapshotError:
            raise SnapshotError(
                f"none of the {len(listings)} snapshot(s) under {store.url} verifies; "
                f"`elastictrain snapshots verify {store.url}` says why"
            ) from None
        assert found is not None  # open_store made sure there are prefixes
        return found
    chosen = [listing for listing in listings if listing.step == step]
    if not chosen:
        steps = ", ".join(str(listing.step) for listing in listings[-10:])
        raise SnapshotError(f"no snapshot at step {step} under {store.url}; steps there: {steps}")
    try:
        return store.read_verified(chosen[0].snapshot_id)
    except SnapshotError as exc:
        raise SnapshotError(f"{exc}; pick another with --step, or none for the newest valid") from None


def _load(payload: dict[str, ObjectData], role: str, where: str) -> Any:
    """Load the snapshot's "model" or "state" object (weights_only); torch is imported only here."""
    from elastictrain.snapshot.format import MODEL_OBJECT, STATE_OBJECT, load_object

    name = {"model": MODEL_OBJECT, "state": STATE_OBJECT}[role]
    if name not in payload:
        raise SnapshotError(f"{where} has no '{name}' object; it was not written by elastictrain")
    return load_object(payload[name], where)


def _weights(store: SnapshotStore, manifest: Manifest, payload: dict[str, ObjectData], where: str) -> Any:
    """The snapshot's whole model state_dict: its model object, or its shards consolidated (dist.strategy=fsdp)."""
    if not manifest.meta.get("sharded"):
        return _load(payload, "model", where)
    from elastictrain.snapshot.sharded import consolidated_model

    try:
        return consolidated_model(store.prefix_url(manifest.step), store.client.options)
    except Exception as exc:  # noqa: BLE001 - a shard DCP cannot read: one line, the snapshot is left as it is
        raise SnapshotError(f"{where}: its shards cannot be read ({one_line(exc, 300)})") from None


def show_document(store: SnapshotStore, listings: list[SnapshotListing], step: int | None) -> dict[str, Any]:
    """Config, progress, attempts and a history summary of one snapshot."""
    manifest, payload = select(store, listings, step)
    where = f"snapshot {store.url}/{manifest.snapshot_id}"
    state = _load(payload, "state", where)
    weights = _weights(store, manifest, payload, where)
    records = list((state.get("history") or {}).get("records") or [])
    attempts = attempts_of(state)
    return {
        "url": store.url,
        "snapshot_id": manifest.snapshot_id,
        "step": manifest.step,
        "newest": manifest.step == listings[-1].step,
        "created_unix": manifest.created_unix,
        "created": _iso(manifest.created_unix),
        "objects": {name: entry.size for name, entry in manifest.objects.items()},
        "size_bytes": sum(entry.size for entry in manifest.objects.values()),
        "meta": manifest.meta,
        "format_version": state.get("format_version"),
        "progress": state.get("progress"),
        "env": state.get("env"),
        "attempts": attempts,
        "restarts": sum(len(marker.restart_counts) for marker in attempt_markers(attempts)),
        "goodput": state.get("goodput"),
        "anomalies": state.get("anomalies"),
        "history": _history_summary(records),
        "model": _model_summary(weights),
        "config": state.get("config"),
    }


def attempts_of(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's attempts a snapshot records (``run_log.attempts``); [] where it has no run log."""
    return list((state.get("run_log") or {}).get("attempts") or [])


def _history_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if any(key.startswith("val_") for key in r)]
    return {
        "records": len(records),
        "train_records": len(train),
        "val_records": len(val),
        "first_train": train[0] if train else None,
        "last_train": train[-1] if train else None,
        "last_val": val[-1] if val else None,
    }


def _model_summary(weights: Any) -> dict[str, Any]:
    tensors = {name: value for name, value in weights.items() if hasattr(value, "numel")}
    return {
        "tensors": len(tensors),
        "parameters": sum(int(value.numel()) for value in tensors.values()),
        "dtypes": sorted({str(value.dtype).removeprefix("torch.") for value in tensors.values()}),
    }


def newest_or_fail(store: SnapshotStore, listings: list[SnapshotListing]) -> tuple[Manifest, dict[str, ObjectData]]:
    """The newest committed snapshot, verified; SnapshotError if it does not verify (no falling back)."""
    committed = [listing for listing in listings if listing.manifest is not None]
    if not committed:
        raise SnapshotError(f"no committed snapshot under {store.url} (no manifest in any step-* prefix)")
    try:
        return store.read_verified(committed[-1].snapshot_id)
    except SnapshotError as exc:
        raise SnapshotError(
            f"{exc}; --newest-or-fail exports nothing older (without it the newest valid snapshot "
            "is exported, --step N picks one)"
        ) from None


def export_document(
    store: SnapshotStore,
    listings: list[SnapshotListing],
    step: int | None,
    out: str,
    fmt: str,
    newest_only: bool = False,
) -> dict[str, Any]:
    """Write the model weights of one snapshot to `out` as a plain state_dict (torch or safetensors).

    By default the newest snapshot that verifies; ``step`` picks one; ``newest_only`` refuses to fall back
    past a newest snapshot that does not verify."""
    if newest_only and step is not None:
        raise ElastictrainError("--newest-or-fail and --step exclude each other; give one")
    if fmt == "safetensors":
        try:
            from safetensors.torch import save as safetensors_bytes
        except ImportError:
            raise ElastictrainError(
                "--format safetensors needs the safetensors package, which is not installed; "
                "pip install safetensors, or export in the default torch format"
            ) from None
    from elastictrain.snapshot.format import MODEL_OBJECT

    manifest, payload = newest_or_fail(store, listings) if newest_only else select(store, listings, step)
    where = f"snapshot {store.url}/{manifest.snapshot_id}"
    weights = _weights(store, manifest, payload, where)
    if not all(hasattr(value, "numel") for value in weights.values()):
        raise SnapshotError(f"{where}: '{MODEL_OBJECT}' is not a state_dict of tensors")
    if fmt == "safetensors":
        # safetensors refuses tensors that share memory (tied weights): give each its own copy.
        data = safetensors_bytes(
            {name: tensor.detach().clone().contiguous() for name, tensor in weights.items()},
            metadata={"elastictrain_snapshot": f"{store.url}/{manifest.snapshot_id}", "step": str(manifest.step)},
        )
    elif MODEL_OBJECT in payload:
        data = payload[MODEL_OBJECT]  # already exactly a torch.save'd state_dict, verified above
    else:  # a sharded snapshot's model, consolidated
        import io

        import torch

        buffer = io.BytesIO()
        torch.save(weights, buffer)
        data = buffer.getvalue()
    _write_atomically(Path(out), data)
    return {
        "url": store.url,
        "snapshot_id": manifest.snapshot_id,
        "step": manifest.step,
        # The newest committed snapshot's step: a pipeline sees that an older one was exported.
        "newest_step": max(listing.step for listing in listings if listing.manifest is not None),
        "chosen_by": "step" if step is not None else "newest" if newest_only else "newest valid",
        "out": str(out),
        "format": fmt,
        "size_bytes": len(data),
        **_model_summary(weights),
    }


def _write_atomically(path: Path, data: bytes) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise StorageError(f"cannot write {path} ({exc.strerror or exc}); check the --out path") from None


def plot_document(
    store: SnapshotStore, listings: list[SnapshotListing], step: int | None, out_dir: str
) -> dict[str, Any]:
    """Draw the history of one snapshot (the newest valid by default) as PNG files in `out_dir`."""
    manifest, payload = select(store, listings, step)
    where = f"snapshot {store.url}/{manifest.snapshot_id}"
    state = _load(payload, "state", where)
    records = list((state.get("history") or {}).get("records") or [])
    if not records:
        raise SnapshotError(f"{where} has no metric history to plot")
    run_name = ((state.get("config") or {}).get("run") or {}).get("name")
    try:
        paths = write_plots(records, attempts_of(state), out_dir, run_name=run_name)
    except OSError as exc:
        raise StorageError(f"cannot write plots into {out_dir} ({exc.strerror or exc}); check --out") from None
    return {
        "url": store.url,
        "snapshot_id": manifest.snapshot_id,
        "step": manifest.step,
        "files": [str(path) for path in paths],
    }


# -- prune ------------------------------------------------------------------------------------


def prune_document(store: SnapshotStore, listings: list[SnapshotListing], keep: int) -> dict[str, Any]:
    """Keep the newest `keep` committed snapshots, and never delete the newest one that verifies."""
    if keep < 1:
        raise ElastictrainError(f"--keep must be at least 1, got {keep}")
    manifest, _ = select(store, listings, None)
    committed = [listing.step for listing in listings if listing.manifest is not None]
    # If the newest snapshots are corrupt, pruning to `keep` could delete the only good one.
    needed = len([step for step in committed if step >= manifest.step])
    keep_last = max(keep, needed)
    deleted = store.prune(keep_last)
    remaining = [listing.step for listing in store.list_snapshots()]
    return {
        "url": store.url,
        "keep": keep,
        "kept_for_newest_valid": keep_last > keep,
        "newest_valid_step": manifest.step,
        "deleted": [int(snapshot_id.split("-", 1)[1]) for snapshot_id in deleted],
        "remaining": remaining,
    }


def _iso(unix: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(unix).astimezone().isoformat(timespec="seconds")
