"""Distributed checkpoints that never lose a run: atomic DCP saves, resume on any layout, seed
checkpoints, Hugging Face export (see the README's "Checkpoints" section)."""

from .manager import CheckpointManager
from .store import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager"]
