"""User-facing error types.

Each is one kind of mistake a user can fix (a config key, a store, a snapshot, a launch
environment). The command line prints the message as one line and exits non-zero; internal
bugs are any other exception and keep their traceback.

``retryable`` says whether a restart of the same job could succeed. A non-retryable error
(a config key, a snapshot of another model, a wrong credential) fails every restart the same
way, so the first attempt records it and later attempts stop at once with one line instead of
repeating the traceback ``--max-restarts`` times.
"""


class ElastictrainError(Exception):
    """Base class: the message says what is wrong and what to do."""

    exit_code = 1
    retryable = False


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


class PeerLost(ElastictrainError):
    """A collective failed because another rank died or hung; the launcher restarts the group."""

    retryable = True
