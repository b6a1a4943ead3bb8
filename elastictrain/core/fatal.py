"""An error no restart can fix, said once on a node and remembered there for torchrun's later attempts, without torch.

torchrun restarts a failed worker group whatever its exit code, up to ``--max-restarts``, and
gives a worker no way to stop it short of signalling the agent (which then dies with a
traceback of its own). So a config error would be said by every rank of every attempt, each
attempt paying an interpreter start and a torch import before it learns that. Instead the first
rank of the node to meet such an error creates a marker in the directory torchrun keeps for
this agent's run (the parent of each attempt's ``attempt_<n>`` folder, unique to the agent:
``tempfile.mkdtemp`` under ``--log-dir``) and says the error; every other rank of that attempt,
and every later attempt stops at once: ``import elastictrain`` (the package's ``__init__``) reads
the marker before anything imports torch, and the node's local rank 0 says the line again (one
line per later attempt), so ``python -m elastictrain train`` costs an interpreter start only and a
script that imports elastictrain before torch does too. ``elastictrain-run`` (launch.py) reads the
same marker when a worker fails and makes no restart at all.

Other nodes learn of an error met on one node through the run's store (``dist.record_fatal_error``).
Without torchrun, or where its directory layout is not the one expected, there is no marker and
every process says its error as before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elastictrain.core.errors import ElastictrainError

SAY_WAIT_S = 30.0  # how long the other local ranks of a later attempt wait for local rank 0's line

MARKER_NAME = "elastictrain-fatal-error.json"
_SAID = "_elastictrain_says_it"  # on an exception: whether this process says it, once decided


@dataclass(frozen=True)
class FatalRecord:
    restart: int  # the attempt (TORCHELASTIC_RESTART_COUNT) that met the error
    rank: int
    kind: str
    exit_code: int
    message: str = ""

    def line(self, restart: int) -> str:
        """What a later attempt (``restart``) says before it stops."""
        return (
            f"elastictrain: error: {self.message or self.kind} (rank {self.rank} met it in attempt {self.restart}; "
            f"restart {restart} stopped at once: no restart can fix it)"
        )


def marker_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The marker of this torchrun agent's run, or None outside torchrun (or in a layout not recognised)."""
    env = os.environ if environ is None else environ
    error_file, restart = env.get("TORCHELASTIC_ERROR_FILE"), env.get("TORCHELASTIC_RESTART_COUNT")
    if not error_file or restart is None:
        return None
    # <log dir>/<run id>_<random>/attempt_<restart>/<local rank>/error.json
    parents = Path(error_file).parents
    if len(parents) < 3 or parents[1].name != f"attempt_{restart}":
        return None
    return parents[2] / MARKER_NAME


def claim_line(error: ElastictrainError, environ: Mapping[str, str] | None = None) -> bool:
    """True when this process should print ``error``: under torchrun, only the first process of the node that met it.

    The answer is kept on the exception, so the rank that logs it in ``fit()`` also prints it on
    the command line. A retryable error is always said (each rank's view of a lost peer differs);
    outside torchrun too.
    """
    if error.retryable:
        return True
    marker = marker_path(environ)
    if marker is None:
        return True
    decided = getattr(error, _SAID, None)
    if decided is not None:  # asked again (logged in fit(), then printed by the command line): the same answer
        return decided
    said = _create_marker(error, marker, environ)
    setattr(error, _SAID, said)
    return said


def _create_marker(error: ElastictrainError, marker: Path, environ: Mapping[str, str] | None) -> bool:
    env = os.environ if environ is None else environ
    record = {
        "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "rank": int(env.get("RANK", "0")),
        "kind": type(error).__name__,
        "exit_code": error.exit_code,
        "message": str(error),
    }
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False  # another rank of this node said it, in this attempt or an earlier one
    except OSError:
        return True  # the directory is gone or read-only: say it rather than lose it
    with os.fdopen(fd, "w") as out:
        json.dump(record, out)
    return True


def earlier_attempt_failed(environ: Mapping[str, str] | None = None) -> FatalRecord | None:
    """The error an earlier attempt of this torchrun agent met and no restart can fix, if any."""
    env = os.environ if environ is None else environ
    marker = marker_path(env)
    record = read_marker(marker) if marker is not None else None
    return record if record is not None and record.restart < int(env["TORCHELASTIC_RESTART_COUNT"]) else None


def read_marker(marker: Path) -> FatalRecord | None:
    """The record in ``marker``; None when there is none (or one torn by a kill: that attempt finds out for itself)."""
    try:
        return FatalRecord(**json.loads(marker.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def stop_if_an_earlier_attempt_failed(environ: Mapping[str, str] | None = None) -> None:
    """Under torchrun, end this worker at once (SystemExit with the error's code) when an earlier attempt of this
    agent met an error no restart can fix; the node's local rank 0 says it in one line first."""
    env = os.environ if environ is None else environ
    earlier = earlier_attempt_failed(env)
    if earlier is None:
        return
    restart = int(env["TORCHELASTIC_RESTART_COUNT"])
    marker = marker_path(env)
    assert marker is not None  # earlier_attempt_failed found a record in it
    said = marker.with_name(f"said-{restart}")  # local rank 0 has printed this attempt's line
    if env.get("LOCAL_RANK", "0") == "0":
        print(earlier.line(restart), file=sys.stderr, flush=True)
        said.touch()
    else:
        # torchrun stops the whole group when one worker exits: a rank that exited at once could end local rank 0
        # (still starting its interpreter) before it said the line. Wait for it, boundedly.
        deadline = time.monotonic() + SAY_WAIT_S
        while not said.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    raise SystemExit(earlier.exit_code)
