"""The text ``elastictrain snapshots ...`` and ``elastictrain plot`` print: each command's document, for a terminal.

``snapshot_tools.py`` builds the documents (what ``--json`` prints); a ``render_*`` function here
turns one into lines that fit 80 columns, and says nothing the document does not.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

WIDTH = 80
MAX_ATTEMPTS_SHOWN = 10


def render_list(document: dict[str, Any]) -> str:
    rows = document["snapshots"]
    # SIZES, not VALID: a flipped byte keeps every size; only `verify` reads the bytes.
    table = [("STEP", "EPOCH", "CREATED", "SIZE", "WORLD", "SIZES")] + [
        (
            str(row["step"]),
            _or_dash(row["epoch"]),
            _local_time(row["created_unix"]),
            _human_bytes(row["size_bytes"]),
            _or_dash(row["world_size"]),
            "ok" if row["sizes_ok"] else "BAD",
        )
        for row in rows
    ]
    lines = [*_wrap(f"{len(rows)} snapshot(s) under {document['url']}"), *_columns(table, right={0, 1, 3, 4})]
    for row in rows:
        if not row["sizes_ok"]:
            lines += _wrap(f"step {row['step']}: {row['problem']}", indent="  ")
    lines.append("(SIZES: manifest present, each object's size as it says; checksums are not read:")
    lines.append(" `elastictrain snapshots verify` reads them)")
    return "\n".join(lines)


def render_verify(document: dict[str, Any]) -> str:
    lines = _wrap(f"verified {len(document['snapshots'])} snapshot(s) under {document['url']}")
    for row in document["snapshots"]:
        if row["valid"]:
            lines.append(
                f"  step {row['step']:>9}  ok   {row['objects']} objects, {_human_bytes(row['size_bytes'])}, checksums match"
            )
        else:
            lines.append(f"  step {row['step']:>9}  BAD")
            lines += _wrap(row["problem"], indent="      ", subsequent="      ")
    if document["newest_valid"]:
        bad = len(document["invalid_steps"])
        lines.append(
            f"newest snapshot (step {document['newest_step']}) is valid"
            + (f"; {bad} older one(s) are not" if bad else "")
        )
    elif document["newest_valid_step"] is not None:
        lines.append(
            f"newest snapshot (step {document['newest_step']}) is INVALID; "
            f"a restore would fall back to step {document['newest_valid_step']}"
        )
    else:
        lines.append("no snapshot is valid; a restore would stop with an error")
    return "\n".join(lines)


def render_show(document: dict[str, Any]) -> str:
    progress, env, history = document["progress"] or {}, document["env"] or {}, document["history"]
    model = document["model"]
    objects = ", ".join(f"{name} {_human_bytes(size)}" for name, size in sorted(document["objects"].items()))
    lines = _wrap(
        f"snapshot  {document['url']}/{document['snapshot_id']}" + ("" if document["newest"] else "  (not the newest)"),
        subsequent=" " * 10,
    )
    lines += _wrap(
        f"created   {_local_time(document['created_unix'])}, {_human_bytes(document['size_bytes'])} ({objects})"
    )
    lines.append(
        f"progress  step {progress.get('global_step')}, epoch {progress.get('epoch')} "
        f"(sample {progress.get('epoch_offset')} of it), {progress.get('samples_seen')} samples seen"
    )
    lines.append(
        f"          last evaluated at step {progress.get('last_evaluated_step')}, "
        f"last snapshot at step {progress.get('last_snapshot_step')}"
    )
    lines.append(
        f"world     {env.get('world_size')} worker(s), {env.get('num_threads')} intra-op thread(s), "
        f"torch {env.get('torch_version')}, snapshot format {document['format_version']}"
    )
    lines.append(
        f"model     {model['tensors']} tensors, {model['parameters']:,} parameters ({', '.join(model['dtypes'])})"
    )
    lines += _render_attempts(document["attempts"], document["restarts"])
    if document["goodput"]:
        lines += _wrap(f"goodput   {_render_goodput(document['goodput'])}", subsequent=" " * 10)
    lines += _render_anomalies(document.get("anomalies") or {})
    lines += _render_history(history)
    lines += _render_config(document["config"] or {})
    return "\n".join(lines)


def _render_anomalies(anomalies: dict[str, Any]) -> list[str]:
    """One line per anomaly the run met (anomalies.py), and the skip lists."""
    entries = anomalies.get("entries") or []
    if not entries and not anomalies.get("skipped_samples") and not anomalies.get("skipped_steps"):
        return []
    counts = anomalies.get("counts") or {}
    lines = [f"anomalies {len(entries)}: " + ", ".join(f"{name} {count}" for name, count in counts.items() if count)]
    for entry in entries:
        value = entry.get("value")
        text = (
            f"  step {entry.get('step')}: {entry.get('kind')} {_number(value) if value is not None else '-'}, "
            f"{entry.get('decision')}"
        )
        if entry.get("ranks"):
            text += f", rank(s) {', '.join(str(r) for r in entry['ranks'])}"
            if entry.get("hosts"):
                text += f" ({', '.join(sorted(set(entry['hosts'])))})"
        if entry.get("origin") and len(entry["origin"]) < len(entry.get("ranks") or []):
            text += f", non-finite loss first on rank(s) {', '.join(str(r) for r in entry['origin'])}"
        if entry.get("rolled_back_to") is not None:
            text += f", rolled back to step {entry['rolled_back_to']}"
        if entry.get("samples"):
            text += f", {len(entry['samples'])} samples"
        lines += _wrap(text, subsequent=" " * 4)
    for name, label in (("skipped_samples", "samples"), ("skipped_steps", "steps")):
        listed = anomalies.get(name) or []
        if listed:
            lines += _wrap(f"  skipped {label}: {', '.join(str(i) for i in listed)}", subsequent=" " * 4)
    return lines


def _render_goodput(goodput: dict[str, Any]) -> str:
    """``0.84 (12.4s productive of 14.8s; evaluate 2.3s, restore 0.1s)``: the ratio, then where the rest went."""
    seconds = goodput.get("seconds_by_cause", goodput)
    total = sum(seconds.values())
    if total <= 0:
        return "nothing counted yet"
    productive = seconds.get("productive", 0.0)
    lost = ", ".join(
        f"{cause} {_seconds(value)}"
        for cause, value in sorted(seconds.items(), key=lambda item: -item[1])
        if cause != "productive" and value > 0
    )
    return f"{productive / total:.2f} ({_seconds(productive)} productive of {_seconds(total)}" + (
        f"; {lost})" if lost else ")"
    )


def _render_config(config: dict[str, Any]) -> list[str]:
    """The keys that differ from the built-in defaults; ``--json`` has the whole config."""
    from elastictrain.core.config_load import load_config  # pydantic only here: listing and verifying stay light

    defaults = dict(_flatten(load_config(None).to_dict(redact=True)))
    changed = [(key, value) for key, value in _flatten(config) if defaults.get(key) != value]
    lines = [
        f"config    {len(changed)} key(s) differ from the defaults (--json has the whole config)"
        + (":" if changed else "")
    ]
    for key, value in changed:
        lines += _wrap(f"  {key} = {value}", subsequent="      ")
    return lines


def _render_attempts(attempts: list[dict[str, Any]], restarts: int) -> list[str]:
    if not attempts:
        return ["attempts  not recorded in this snapshot"]
    lines = [f"attempts  {len(attempts)} ({restarts} restart(s))"]
    shown = attempts[-MAX_ATTEMPTS_SHOWN:]
    if len(attempts) > len(shown):
        lines.append(f"  ... {len(attempts) - len(shown)} earlier attempt(s) not shown (--json has all)")
    table = [("#", "RESTART", "WORLD", "FROM STEP", "STARTED", "LAUNCHER", "REASON")]
    first_number = len(attempts) - len(shown) + 1
    for number, attempt in enumerate(shown, first_number):
        table.append(
            (
                str(number),
                _or_dash(attempt.get("restart_count")),
                _or_dash(attempt.get("world_size")),
                _or_dash(attempt.get("start_step")),
                _local_time(attempt.get("started_unix")),
                _or_dash(attempt.get("launcher")),
                _or_dash(attempt.get("reason")),
            )
        )
    return lines + [f"  {line}" for line in _columns(table, right={0, 1, 2, 3}, width=WIDTH - 2)]


def _render_history(history: dict[str, Any]) -> list[str]:
    lines = [
        f"history   {history['records']} records ({history['train_records']} train, "
        f"{history['val_records']} validation)"
    ]
    first, last = history["first_train"], history["last_train"]
    if first is not None:
        lines.append(
            f"  train_loss  {first['train_loss']:.4f} at step {first.get('step')} -> "
            f"{last['train_loss']:.4f} at step {last.get('step')}"
        )
    if history["last_val"] is not None:
        val_keys = sorted(
            (key for key in history["last_val"] if key.startswith("val_")), key=lambda k: (k != "val_loss", k)
        )
        metrics = ", ".join(f"{key} {_number(history['last_val'][key])}" for key in val_keys)
        lines += _wrap(f"  last val    step {history['last_val'].get('step')}: {metrics}", subsequent=" " * 14)
    return lines


def render_export(document: dict[str, Any]) -> str:
    lines = _wrap(
        f"exported step {document['step']}: wrote {document['out']} ({document['format']}, "
        f"{_human_bytes(document['size_bytes'])}): {document['tensors']} tensors, {document['parameters']:,} "
        f"parameters ({document['url']}/{document['snapshot_id']})"
    )
    if document["step"] != document["newest_step"] and document["chosen_by"] == "newest valid":
        lines += _wrap(
            f"not the newest snapshot: step {document['newest_step']} does not verify (`elastictrain "
            "snapshots verify` says why); --newest-or-fail makes that an error, --step N picks one"
        )
    return "\n".join(lines)


def render_plot(document: dict[str, Any]) -> str:
    return "\n".join(
        [*_wrap(f"plotted step {document['step']} of {document['url']}:"), *(f"  {p}" for p in document["files"])]
    )


def render_prune(document: dict[str, Any]) -> str:
    deleted, remaining = document["deleted"], document["remaining"]
    lines = _wrap(
        f"deleted {len(deleted)} snapshot(s) under {document['url']}"
        + (f": step {', '.join(map(str, deleted))}" if deleted else "")
    )
    lines += _wrap(f"remaining {len(remaining)}: step {', '.join(map(str, remaining))}")
    if document["kept_for_newest_valid"]:
        lines += _wrap(
            f"kept more than --keep {document['keep']}: the newest valid snapshot is step "
            f"{document['newest_valid_step']}, newer ones do not verify"
        )
    return "\n".join(lines)


# -- formatting -------------------------------------------------------------------------------


def _columns(table: Sequence[tuple[str, ...]], right: AbstractSet[int] = frozenset(), width: int = WIDTH) -> list[str]:
    """Align a table; the last column is cut with '...' so each line fits `width`."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        line = "  ".join(cells).rstrip()
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    return lines


def _wrap(text: str, indent: str = "", subsequent: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + "    " if subsequent is None else subsequent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent]


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    items = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", _yaml_scalar(value)))
    return items


def _yaml_scalar(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    if size < 1024:
        return f"{size} B"
    scaled = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        scaled /= 1024
        if scaled < 1024:
            return f"{scaled:.1f} {unit}"
    return f"{scaled / 1024:.1f} TiB"


def _local_time(unix: float | None) -> str:
    return "-" if unix is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _seconds(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, (int, float)) else str(value)
