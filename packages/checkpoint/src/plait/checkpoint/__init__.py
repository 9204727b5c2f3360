"""plait.checkpoint: distributed checkpoints that never lose a run, and Hugging Face weights.

    store      atomic publish (temp folder, marker, one rename), CRC32 checksums, the step folders
    state      the DCP state dicts of a model and its optimizer (reshard on load) and per-rank RNG
    hf_export  a DCP checkpoint's model -> a Hugging Face folder (one process), and HF -> plait
    hf_sharded HF weights loaded a layer at a time into a parallelized model, and saved from one
    hf_output  what an HF output folder may be (new, empty or an earlier export) and its publish

When to save, how many to keep and what a resumed run takes from its config stay with the
caller (plait-train's `plait.trainer.checkpoint`).
"""

from .store import CheckpointError, CheckpointWriteError

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CheckpointWriteError", "__version__"]
