"""Attention over a plan of blocks (layout.plan_blocks, documents.plan_document_blocks): forward
merges them, backward splits.

q, out and dout come with stride(-1) == 1, k and v dense (kernels.flash_input_problems): slices of
them along the batch and the sequence are what the kernels take, on CPU and CUDA alike.
"""

from collections.abc import Sequence

import torch

from .documents import DocumentSegments
from .kernels import MergedAttention, accum_dtype, aligned, attention_backward, attention_forward
from .layout import Block, plan_blocks


def plan(q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk: int, segments: DocumentSegments | None):
    """(blocks, unit): the causal plan in chunk units, or the rows' document plan in token units."""
    if segments is None:
        return plan_blocks(q_chunks, kv_chunks), chunk
    return segments.plan(q_chunks, kv_chunks, chunk), 1


def _slices(b: Block, unit: int) -> tuple[slice, slice, slice]:
    return b.batch, slice(b.q0 * unit, b.q1 * unit), slice(b.k0 * unit, b.k1 * unit)


def blocks_forward(acc: MergedAttention, q, k, v, blocks: Sequence[Block], chunk: int, scale: float) -> None:
    """Add every block of q against (k, v) into `acc` (block units of `chunk` tokens)."""
    for b in blocks:
        batch, rows, keys = _slices(b, chunk)
        out, lse = attention_forward(
            aligned(q[batch, :, rows]), aligned(k[batch, :, keys]), aligned(v[batch, :, keys]), b.causal, scale
        )
        acc.add(rows, out, lse, batch)


def blocks_backward(
    dq_acc: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
    dout, q, k, v, out, lse,
    blocks: Sequence[Block],
    chunk: int,
    scale: float,
) -> None:
    """Accumulate (fp32) every block's share of dq, dk, dv given the merged out and lse."""
    for b in blocks:
        batch, rows, keys = _slices(b, chunk)
        # The kernels read the lse as a dense [B, H, Lq] (a strided slice is silently wrong on CUDA);
        # q, out, dout slices keep stride(-1) == 1, which is all the kernels need of them.
        dq, dk, dv = attention_backward(
            aligned(dout[batch, :, rows]), aligned(q[batch, :, rows]), aligned(k[batch, :, keys]),
            aligned(v[batch, :, keys]), aligned(out[batch, :, rows]), lse[batch, :, rows].contiguous(), b.causal, scale,
        )
        dq_acc[batch, :, rows] += dq
        dk_acc[batch, :, keys] += dk
        dv_acc[batch, :, keys] += dv


def segments_forward(q, k, v, blocks: Sequence[Block], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-sequence attention (Ulysses) as one causal call per document segment: the calls
    partition the (row, token) grid, so each writes its own slice of the output and the dense lse."""
    B, H, S, _ = q.shape
    out = q.new_empty(B, H, S, v.shape[-1])
    lse = torch.empty(B, H, S, dtype=accum_dtype(q.dtype), device=q.device)
    for b in blocks:
        batch, rows, _ = _slices(b, 1)
        out[batch, :, rows], lse[batch, :, rows] = attention_forward(
            aligned(q[batch, :, rows]), aligned(k[batch, :, rows]), aligned(v[batch, :, rows]), True, scale
        )
    return out, lse


def segments_backward(dout, q, k, v, out, lse, blocks: Sequence[Block], scale: float):
    """The backward of `segments_forward`: each segment's gradients are its own (no other call sees it)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b in blocks:
        batch, rows, _ = _slices(b, 1)
        dq[batch, :, rows], dk[batch, :, rows], dv[batch, :, rows] = attention_backward(
            aligned(dout[batch, :, rows]), aligned(q[batch, :, rows]), aligned(k[batch, :, rows]),
            aligned(v[batch, :, rows]), aligned(out[batch, :, rows]), lse[batch, :, rows].contiguous(), True, scale,
        )
    return dq, dk, dv
