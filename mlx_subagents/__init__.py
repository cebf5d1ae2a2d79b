"""Coding sub-agents on a local MLX model, in one process."""

__version__ = "0.1.0"
