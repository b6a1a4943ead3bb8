"""elastictrain: fault-tolerant, elastic training for PyTorch."""

__version__ = "0.1.0"

from .config import Config, load_config
from .errors import ConfigError, DistributedSetupError, ElastictrainError, SnapshotError, StorageError
from .loop import RunSummary, Trainer
from .snapshot import seed_rng as seed_everything
from .states import State
from .task import Task

__all__ = [
    "Config", "ConfigError", "DistributedSetupError", "ElastictrainError", "RunSummary",
    "SnapshotError", "State", "StorageError", "Task", "Trainer", "load_config", "seed_everything",
]
