"""Rank-aware logging, the rank-0 JSON-lines log, and the rank-0 progress report (a bar or log lines)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

from tqdm import tqdm

from elastictrain.core.config import LogConfig
from elastictrain.core.errors import ConfigError
from elastictrain.core.events import Observer, RunInfo, TrainInterval

log = logging.getLogger("elastictrain")

JSONL_NAME = "log.jsonl"


def setup_logging(rank: int, restart_count: int, cfg: LogConfig, run_dir: str | None = None) -> None:
    """Every line names its rank and restart, to the millisecond; ranks other than 0 log warnings and errors only.

    With ``log.jsonl`` and a ``run_dir``, rank 0 also appends one JSON object per record to
    ``<run_dir>/log.jsonl`` (every attempt of the run in one file, each line naming its restart).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s.%(msecs)03d [elastictrain r{rank} a{restart_count}] %(levelname)s %(message)s", "%H:%M:%S"
        )
    )
    for old in log.handlers:  # a second run in one process must not leak the first one's open file
        old.close()
    log.handlers[:] = [handler]
    if rank == 0 and cfg.jsonl and run_dir is not None:
        try:
            os.makedirs(run_dir, exist_ok=True)
            json_handler = logging.FileHandler(os.path.join(run_dir, JSONL_NAME), mode="a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"log.jsonl=true but {os.path.join(run_dir, JSONL_NAME)} cannot be written ({exc.strerror or exc}); "
                "point run.dir at a writable directory, or set log.jsonl=false — nothing saved is lost"
            ) from None
        json_handler.setFormatter(JsonLinesFormatter(rank, restart_count))
        log.handlers.append(json_handler)
    log.propagate = False
    level = logging.getLevelName(cfg.level)
    log.setLevel(level if rank == 0 or cfg.all_ranks else max(level, logging.WARNING))


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: UTC time to the millisecond, level, rank, restart, message, and its ``fields``.

    A record logged with ``extra={"fields": {...}}`` carries those numbers as JSON values, so a
    reader gets ``{"step": 100, "train_loss": 0.41, ...}`` without parsing the message.
    """

    def __init__(self, rank: int, restart_count: int) -> None:
        super().__init__()
        self.rank, self.restart_count = rank, restart_count

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        entry = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "rank": self.rank,
            "restart": self.restart_count,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def progress_bar(enabled: bool | str, is_main: bool, total: int, initial: int) -> tqdm | None:
    """A tqdm bar on rank 0; 'auto' shows it only on a terminal (log lines replace it otherwise)."""
    if not is_main or enabled is False or (enabled == "auto" and not sys.stderr.isatty()):
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


class ProgressReport(Observer):
    """Rank 0's view of training, once per log interval: a tqdm bar on a terminal, else a log line.

    The bar shows steps done of the run, epoch, loss, samples/s and (tqdm's own) ETA; without
    a bar each interval is one ``step N epoch E train_loss=... samples/s=...`` line, which the
    JSON-lines log also gets as numbers. Add it on the main rank only: ``if ctx.is_main:``.
    """

    def __init__(self, cfg: LogConfig) -> None:
        self.cfg = cfg
        self.bar: tqdm | None = None
        self._total_steps = 0

    def started(self, info: RunInfo) -> None:
        self._total_steps = info.total_steps

    def restored(self, step: int, duration_s: float, from_snapshot: bool) -> None:
        self.bar = progress_bar(self.cfg.progress_bar, True, self._total_steps, step)

    def trained(self, interval: TrainInterval) -> None:
        samples_per_s = interval.samples / interval.elapsed_s if interval.elapsed_s > 0 else 0.0
        if self.bar is not None:
            postfix = {"epoch": interval.epoch, "samples/s": f"{samples_per_s:.0f}"}
            if "train_loss" in interval.metrics:
                postfix["loss"] = f"{interval.metrics['train_loss']:.4f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(interval.step - self.bar.n)
            return
        record = {**interval.metrics, "samples_per_s": samples_per_s}
        log.info(
            "step %d epoch %d %s samples/s=%.1f",
            interval.step,
            interval.epoch,
            " ".join(f"{k}={v:.4g}" for k, v in interval.metrics.items()),
            samples_per_s,
            extra={"fields": {"event": "train", "step": interval.step, "epoch": interval.epoch, **record}},
        )

    def closed(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def flush_standard_streams() -> None:
    """Flush stdout and stderr before a process ends without the interpreter's finalization."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
