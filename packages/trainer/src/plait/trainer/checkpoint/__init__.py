"""Distributed checkpoints that never lose a run: atomic DCP saves, resume on any layout, seed
checkpoints, Hugging Face export (see the README's "Checkpoints" section)."""

from .store import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager"]


def __getattr__(name: str):
    # The manager is imported on first use, not with the package: `python -m
    # plait.trainer.checkpoint.hf_export` imports this package first, and an eager import of the
    # manager (which imports hf_export) made runpy warn on every call.
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
