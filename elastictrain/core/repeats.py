"""A crash that repeats is a bug, not a fault: the same exception at the same step in a second attempt ends the job.

A restart replays the steps since the snapshot bit for bit (the same samples in the same order,
the same random numbers), so a crash a fault caused (a peer's node, a flaky file system) does not
come back at the same step with the same message, and one the code raises comes back every time.
Each attempt that crashes on a bug records the crash (the exception's type and message, the step,
the attempt, the rank) as one JSON line in the torchrun agent's run directory, beside fatal.py's
marker; a crash that matches one an earlier attempt recorded is its second occurrence, and no
restart follows. Outside torchrun (or in a layout fatal.py does not recognise) nothing restarts
the job, and nothing is recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from elastictrain.core.fatal import marker_path

CRASHES_NAME = "elastictrain-crashes.jsonl"


@dataclass(frozen=True)
class Crash:
    kind: str  # the exception's type
    message: str
    step: int  # the steps done when it was raised
    restart: int  # the attempt (TORCHELASTIC_RESTART_COUNT)
    rank: int

    @property
    def signature(self) -> tuple[str, str, int]:
        """What a replay repeats: the type, the message and the step (not the rank: the world may have changed)."""
        return self.kind, self.message, self.step


def first_occurrence(earlier: Iterable[Crash], now: Crash) -> Crash | None:
    """The crash of an earlier attempt that ``now`` repeats (same type, message and step), or None: ``now`` may be a
    fault, and the launcher's restart is the answer."""
    return next((crash for crash in earlier if crash.restart < now.restart and crash.signature == now.signature), None)


def record_crash(exc: BaseException, step: int, environ: Mapping[str, str] | None = None) -> Crash | None:
    """Record this crash for the attempts after this one; return the earlier crash it repeats, if any."""
    env = os.environ if environ is None else environ
    marker = marker_path(env)
    if marker is None:
        return None
    now = Crash(type(exc).__name__, str(exc), step, int(env["TORCHELASTIC_RESTART_COUNT"]), int(env.get("RANK", "0")))
    path = marker.parent / CRASHES_NAME
    first = first_occurrence(_read(path), now)
    try:
        with open(path, "a") as out:  # one short append per crashed rank: O_APPEND keeps the lines whole
            out.write(json.dumps(asdict(now)) + "\n")
    except OSError:  # the directory is gone or read-only: the next attempt judges its crash as a first one
        pass
    return first


def _read(path: Path) -> list[Crash]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    crashes = []
    for line in lines:
        try:
            crashes.append(Crash(**json.loads(line)))
        except (ValueError, TypeError):  # torn by a kill mid-write
            continue
    return crashes
