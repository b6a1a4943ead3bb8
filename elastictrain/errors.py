"""User-facing error types.

Each is one kind of mistake a user can fix (a config key, a store, a snapshot, a launch
environment). The command line prints the message as one line and exits non-zero; internal
bugs are any other exception and keep their traceback.

``retryable`` says whether a restart of the same job could succeed. A non-retryable error
(a config key, a snapshot of another model, a wrong credential) fails every restart the same
way, so the first attempt records it and later attempts stop at once with one line instead of
repeating the traceback ``--max-restarts`` times.

Uncaught, they print as one line too: importing this module installs a ``sys.excepthook`` that
prints ``elastictrain: error: <message>`` and exits with the error's code, so a ConfigError from
``Trainer(..., overrides=sys.argv[1:])`` in a user's script reads like the command line's.
Every other exception goes to the hook that was there before, traceback and all, unless the
session that saw it logged its traceback already (then it exits 1 without a second copy).
``ELASTICTRAIN_TRACEBACK=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import TracebackType


class ElastictrainError(Exception):
    """Base class: the message says what is wrong and what to do."""

    exit_code = 1
    retryable = False


class LossFnError(ElastictrainError):
    """loss_fn returned something other than a scalar loss tensor, or (loss, {"name": scalar})."""


class UsageError(ElastictrainError):
    """The custom-loop API called out of its protocol (session.py): state registered after restore, a step
    outside TRAIN, a session used outside its ``with`` block. Exits 2, as a config error: no restart can fix it."""

    exit_code = 2


class ReplicasDiverged(UsageError):
    """The ranks' copies of the registered models or optimizers differ (replicas.py): each rank trained its own
    (a model not wrapped by session.wrap(), or the module called instead of its wrapper)."""


class ConfigError(ElastictrainError):
    """The config has a wrong key, a wrong type or a missing value."""

    exit_code = 2


class StorageError(ElastictrainError):
    """The snapshot store cannot be reached, read or written."""


class StorageUnavailable(StorageError):
    """The store did not answer (connection refused, timed out, throttled) even after retries; it may come back."""

    retryable = True


class StoreLeaseError(StorageError):
    """Another live run holds the snapshot store's lease; two runs must not write one store."""


class SnapshotError(ElastictrainError):
    """No snapshot verifies, or the newest one does not fit this run."""


class DistributedSetupError(ElastictrainError):
    """The launch environment (torchrun, SLURM) is incomplete or inconsistent."""

    retryable = True  # a rendezvous store that is not up yet may be up at the next attempt


class RepeatedFatalError(ElastictrainError):
    """An earlier attempt of this job already failed on a non-retryable error; this one stops at once."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RepeatedCrash(ElastictrainError):
    """The same exception at the same step as in an earlier attempt: a restart replays the steps exactly, so it is a
    bug to fix, not a fault (repeats.py). Every snapshot is kept."""


class AnomalyError(ElastictrainError):
    """Anomalies (non-finite or spiking steps) went on past anomaly.max_rollbacks; the snapshots are intact."""


class PeerLost(ElastictrainError):
    """A collective failed because another rank died or hung; the launcher restarts the group."""

    retryable = True


TRACEBACK_ENV = "ELASTICTRAIN_TRACEBACK"
LOGGED = "_elastictrain_logged"  # on a bug's exception: its traceback is in the log already (failures.py)
_previous_excepthook = sys.excepthook


def tracebacks_wanted() -> bool:
    """True when ``ELASTICTRAIN_TRACEBACK`` is set (not empty or 0): user errors keep their traceback."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def _print_user_error(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _exit_if_said(exc)
    _previous_excepthook(exc_type, exc, tb)


def _exit_if_said(exc: BaseException) -> None:
    """SystemExit for an ElastictrainError (said in one line first) or a bug whose traceback is logged already."""
    if isinstance(exc, ElastictrainError) and not tracebacks_wanted():
        with contextlib.suppress(OSError, ValueError):  # a closed stdout must not hide the message
            sys.stdout.flush()  # what the script printed comes first, as with a traceback
        from .fatal import claim_line  # imports this module

        if claim_line(exc):  # under torchrun: once per node, not once per rank and attempt
            print(f"elastictrain: error: {exc}", file=sys.stderr, flush=True)
        # CPython exits with this code when an excepthook raises SystemExit, so a script's
        # config error ends with 2, as on the command line.
        raise SystemExit(exc.exit_code)
    if getattr(exc, LOGGED, False):  # a bug whose traceback the rank that had it logged: once is enough
        raise SystemExit(1)


def keep_excepthook_outermost() -> None:
    """After ``torch.distributed.init_process_group``: it wraps ``sys.excepthook`` to prefix what the hook it wraps
    prints with the rank, into a buffer that is lost when that hook exits, so a user error's line would vanish.
    Ours goes around torch's again; every other exception still reaches torch's (and the prefix)."""
    wrapped = sys.excepthook
    if wrapped is _print_user_error or getattr(wrapped, "_elastictrain_outermost", False):
        return

    def outermost(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _exit_if_said(exc)
        wrapped(exc_type, exc, tb)

    outermost._elastictrain_outermost = True  # type: ignore[attr-defined]
    sys.excepthook = outermost


def install_excepthook() -> None:
    """Print uncaught ElastictrainErrors as one line; every other exception goes to the previous hook."""
    global _previous_excepthook
    if sys.excepthook is not _print_user_error:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _print_user_error


# Installed here, on import: every code path that can raise one of these errors has imported
# this module first, however the package was imported.
install_excepthook()
