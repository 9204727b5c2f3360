"""plait.contextparallel: all-gather, ring and all-to-all (Ulysses) context parallel on CPU and GPU.

    layout = apply_context_parallel(model, meshes.cp, info["attention_modules"], ContextParallelConfig())
    tokens, labels, positions = shard_batch(tokens_BS, labels_BS, cp_rank, layout)
    logits = model(tokens, positions)

See the README and docs/contracts.md (the attention contract it relies on).
"""

from .attention import ContextParallelAttention, apply_context_parallel
from .config import METHODS, ContextParallelConfig, validate_context_parallel
from .kernels import attention_backward, attention_forward
from .layout import SequenceLayout, plan_blocks, shard_batch, shard_sequence, unshard_sequence

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "ContextParallelAttention",
    "ContextParallelConfig",
    "SequenceLayout",
    "apply_context_parallel",
    "attention_backward",
    "attention_forward",
    "plan_blocks",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
    "validate_context_parallel",
]
