"""User-facing error types.

Each is one kind of mistake a user can fix (a config key, a store, a snapshot, a launch
environment). The command line prints the message as one line and exits non-zero; internal
bugs are any other exception and keep their traceback.

``retryable`` says whether a restart of the same job could succeed. A non-retryable error
(a config key, a snapshot of another model, a wrong credential) fails every restart the same
way, so the first attempt records it and later attempts stop at once with one line instead of
repeating the traceback ``--max-restarts`` times.

Uncaught, they print as one line too (excepthook.py). ``ELASTICTRAIN_TRACEBACK=1`` shows the
traceback of user errors too. This module imports nothing of the package: every other one may import it.
"""

from __future__ import annotations

import os


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
LOGGED = "_elastictrain_logged"  # on an exception: this process logged it already (failures.py)


def mark_logged(exc: BaseException) -> None:
    """Say that this process has logged ``exc`` (its line, or a bug's traceback): Python's hook and the command line
    then end the process with its exit code and print nothing more, so the user reads it once."""
    try:
        setattr(exc, LOGGED, True)
    except AttributeError:  # an exception type with __slots__: printed twice rather than lost
        pass


def was_logged(exc: BaseException) -> bool:
    """True when this process has logged ``exc`` already (``mark_logged``)."""
    return getattr(exc, LOGGED, False)


def one_line(exc: BaseException, limit: int | None = None, kind: bool = False) -> str:
    """``exc`` said in one line: its message with white space folded, cut to ``limit`` characters (ending "...").

    With ``kind``, or when the message is empty, the line starts with the exception's class name.
    The one place an exception becomes a line of a message; a user error's own line is its message.
    """
    text = " ".join(str(exc).split())
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    if kind or not text:
        return f"{type(exc).__name__}: {text or 'no message'}"
    return text


def tracebacks_wanted() -> bool:
    """True when ``ELASTICTRAIN_TRACEBACK`` is set (not empty or 0): user errors keep their traceback."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
