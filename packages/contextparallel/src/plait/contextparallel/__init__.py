"""plait.contextparallel: all-gather, ring and all-to-all (Ulysses) context parallel on CPU and GPU.

    layout = apply_context_parallel(model, meshes.cp, info["attention_modules"], ContextParallelConfig())
    tokens, labels, positions = shard_batch(tokens_BS, labels_BS, cp_rank, layout)
    logits = model(tokens, positions)   # document masking: the attention modules also take the
                                        # FULL rows' document_positions [B, S] (same on every cp rank)

    # A model without sdpa submodules (F.scaled_dot_product_attention, transformers):
    cp_sdpa = ContextParallelSDPA(meshes.cp, ContextParallelConfig("ring"))   # SDPA's signature
    with cp_sdpa.patch(): ...   # or AttentionInterface.register("plait_cp", cp_sdpa.transformers_attention)

See the README and docs/contracts.md (the attention contract it relies on).
"""

from .attention import ContextParallelAttention, apply_context_parallel
from .config import ATTENTION_MASKS, METHODS, ContextParallelConfig, validate_context_parallel
from .documents import DocumentSegments, document_segments, plan_document_blocks
from .kernels import attention_backward, attention_forward
from .layout import SequenceLayout, plan_blocks, shard_batch, shard_sequence, unshard_sequence
from .sdpa import ContextParallelSDPA
from .work import PerDocumentHeadTail, attention_work, imbalance

__version__ = "0.2.0"

__all__ = [
    "ATTENTION_MASKS",
    "METHODS",
    "ContextParallelAttention",
    "ContextParallelConfig",
    "ContextParallelSDPA",
    "DocumentSegments",
    "PerDocumentHeadTail",
    "SequenceLayout",
    "apply_context_parallel",
    "attention_backward",
    "attention_forward",
    "attention_work",
    "document_segments",
    "imbalance",
    "plan_blocks",
    "plan_document_blocks",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
    "validate_context_parallel",
]
