"""User-facing error types.

Each is one kind of mistake a user can fix (a config key, a store, a snapshot, a launch
environment). The command line prints the message as one line and exits non-zero; internal
bugs are any other exception and keep their traceback.
"""


class ElastictrainError(Exception):
    """Base class: the message says what is wrong and what to do."""

    exit_code = 1


class ConfigError(ElastictrainError):
    """The config has a wrong key, a wrong type or a missing value."""

    exit_code = 2


class StorageError(ElastictrainError):
    """The snapshot store cannot be reached, read or written."""


class SnapshotError(ElastictrainError):
    """No snapshot verifies, or the newest one does not fit this run."""


class DistributedSetupError(ElastictrainError):
    """The launch environment (torchrun, SLURM) is incomplete or inconsistent."""
