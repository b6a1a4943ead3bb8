"""elastictrain: fault-tolerant, elastic training for PyTorch."""

__version__ = "0.1.0"
