"""plait.checkpoint: distributed checkpoints that never lose a run, and Hugging Face weights.

    store      atomic publish (temp folder, marker, one rename), CRC32 checksums, the step folders
    state      the DCP state dicts of a model and its optimizer (reshard on load) and per-rank RNG
    hf_export  a DCP checkpoint's model -> a Hugging Face folder (one process), and HF -> plait
    hf_sharded HF weights loaded a layer at a time into a parallelized model, and saved from one
    hf_shards  which rank writes which files of that export (huggingface_hub's split) and the index
    hf_output  what an HF output folder may be (new, empty or an earlier export) and its publish
    writer     CheckpointWriter: every rank's part written (or from a thread), hashed, published by rank 0
    reader     the checkpoint to resume from, chosen by rank 0 and verified by every rank
    folder_lock one live process per folder
    collect    the collectives these use (no-ops without a process group), the tests' kill hooks

When to save, how many to keep and what a resumed run takes from its config stay with the
caller (plait-train's `plait.trainer.checkpoint`).
"""

from .store import CheckpointError, CheckpointWriteError

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CheckpointWriteError", "__version__"]
