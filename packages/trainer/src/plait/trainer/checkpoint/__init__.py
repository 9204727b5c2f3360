"""plait-train's checkpoint policy over plait-checkpoint: when to save, keep_last, resume rules, the
train state and the `hf_export` command (see the README's "Checkpoints" section)."""

from plait.checkpoint.store import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager"]


def __getattr__(name: str):
    # The manager is imported on first use, not with the package: `python -m
    # plait.trainer.checkpoint.hf_export` imports this package first, and an eager import of the
    # manager (which imports hf_export) made runpy warn on every call.
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
