"""Activation checkpointing of a model's blocks: full, or selective (op-level) recomputation.

The block's forward is wrapped in place (`block.forward = ...`) rather than the block replaced
by a wrapper module, so module paths and parameter names stay what `parallel_info()` says —
FSDP, compile and checkpoints keep using them unchanged.
"""

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import plait.models.document_attention  # noqa: F401  (registers plait::document_attention)
import plait.models.moe.grouped_mm_op  # noqa: F401  (registers plait::grouped_mm)

# Outputs worth keeping under selective checkpointing: the matmuls and attention, which are the
# expensive ops to recompute. Everything else (norms, activations, RoPE, casts) is recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
# Collectives are saved too: recomputing them would communicate twice. Tensor parallel's, and
# expert parallel's dispatch / combine (`all_to_all_single_autograd` records
# `_c10d_functional.all_to_all_single` under the selective-checkpoint dispatch mode).
for _name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "all_to_all_single"):
    _op = getattr(torch.ops._c10d_functional, _name, None)
    if _op is not None:
        _SAVE_OPS.add(_op.default)
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)
# plait's own kernel ops, registered when plait.models is imported: document attention (one op per
# layer, its output and log-sum-exp) and the experts' grouped GEMM, whose insides SAC never sees.
_SAVE_OPS.update({torch.ops.plait.document_attention.default, torch.ops.plait.grouped_mm.default})


# Profiler ranges are not computation, but SAC counts every op it sees and asks the recompute for
# the same sequence: FSDP opens its ranges (`record_function("FSDP::pre_forward")`, ...) a different
# number of times when a nested FSDP unit (experts sharded over efsdp > 1) runs in the forward and
# when it runs in the recompute, and the backward fails with "_record_function_enter_new
# invocation index N ... not found in storage". torch ignores a few such ops already
# (`SAC_IGNORED_OPS`: detach, device); the profiler's join them.
for _name, _overload in (("_record_function_enter_new", "default"), ("_record_function_enter", "default"),
                         ("_record_function_exit", "_RecordFunction")):
    _packet = getattr(torch.ops.profiler, _name, None)
    if _packet is not None and hasattr(_packet, _overload):
        torch.utils.checkpoint.SAC_IGNORED_OPS.add(getattr(_packet, _overload))


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(forward, mode: str):
    context_fn = _selective_context if mode == "selective" else None

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        kw = {"context_fn": context_fn} if context_fn else {}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kw, **kwargs)

    return wrapped


def apply_activation_checkpointing(model: nn.Module, blocks: Sequence[str], mode: str, every: int = 1) -> list[str]:
    """Checkpoint blocks 0, every, 2*every, ... with `mode` ("full" or "selective"); return their paths."""
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpoint mode {mode!r}: use none, full or selective")
    chosen = [path for i, path in enumerate(blocks) if i % max(1, every) == 0]
    for path in chosen:
        block = model.get_submodule(path)
        block.forward = _checkpointed(block.forward, mode)
    return chosen
