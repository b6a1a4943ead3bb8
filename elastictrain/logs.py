"""Rank-aware logging and the rank-0 progress bar."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from .config import LogConfig

log = logging.getLogger("elastictrain")


def setup_logging(rank: int, restart_count: int, cfg: LogConfig) -> None:
    """Every line names its rank and restart; ranks other than 0 log warnings and errors only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [elastictrain r{rank} a{restart_count}] %(levelname)s %(message)s", "%H:%M:%S")
    )
    log.handlers[:] = [handler]
    log.propagate = False
    level = logging.getLevelName(cfg.level)
    log.setLevel(level if rank == 0 or cfg.all_ranks else max(level, logging.WARNING))


def progress_bar(enabled: bool | str, is_main: bool, total: int, initial: int) -> tqdm | None:
    """A tqdm bar on rank 0; 'auto' shows it only on a terminal (log lines replace it otherwise)."""
    if not is_main or enabled is False or (enabled == "auto" and not sys.stderr.isatty()):
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
