"""Attention over a plan of blocks (layout.plan_blocks, documents.plan_document_blocks): forward
merges them, backward splits.

q, out and dout come with stride(-1) == 1, k and v dense (kernels.flash_input_problems): slices of
them along the batch and the sequence are what the kernels take, on CPU and CUDA alike.
"""

from collections.abc import Sequence

import torch

from .documents import DocumentSegments
from .kernels import (
    MergedAttention,
    aligned,
    attention_backward,
    attention_forward,
    documents_backward,
    documents_forward,
)
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


class Diagonal:
    """A document plan's causal squares as ONE kernel call over the rows folded into B x L tokens.

    Every query lies in exactly one causal square (it sees itself), so the squares tile the local
    buffer: their query ranges, row by row, are the offsets of one variable-length call (on CUDA one
    FlashAttention-2 varlen call per layer instead of one per document; on the CPU one flash call
    per document, as before). A square's keys are the same tokens as its queries, so the call
    takes the rank's own K/V. Built on the host once per plan; the offsets go to the device once.
    """

    def __init__(self, squares: Sequence[Block], batch: int, length: int, device):
        starts = sorted({(row, b.q0, b.q1) for b in squares for row in range(b.b0, batch if b.b1 is None else b.b1)})
        bounds = [row * length + q0 for row, q0, _ in starts] + [batch * length]
        ends = [row * length + q1 for row, _, q1 in starts]
        if bounds[0] != 0 or ends != bounds[1:]:
            raise AssertionError(f"the causal squares do not tile the [{batch} x {length}] queries: {starts}")
        self.bounds = bounds
        self.max_len = max(e - s for s, e in zip(bounds, bounds[1:]))
        self.cu_seqlens = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)

    @classmethod
    def split(cls, segments: DocumentSegments, blocks: Sequence[Block], q_shape, key, device):
        """(the causal squares as one Diagonal, the other blocks) of a document plan; the Diagonal is
        built once per (plan key, device) and kept on `segments` for every layer and the backward."""
        cache = segments.__dict__.setdefault("_diagonals", {})
        squares = [b for b in blocks if b.causal]
        full = [b for b in blocks if not b.causal]
        if (key, device) not in cache:
            cache[(key, device)] = cls(squares, q_shape[0], q_shape[2], device) if squares else None
        return cache[(key, device)], full


def _fold(x_BHLD: torch.Tensor) -> torch.Tensor:
    B, H, L, D = x_BHLD.shape
    return x_BHLD.transpose(1, 2).reshape(B * L, H, D)


def diagonal_forward(acc: MergedAttention, q, k, v, diagonal: Diagonal, scale: float) -> None:
    """Merge the Diagonal's call (q against the rank's own k, v: [B, *, L, *]) into `acc`."""
    B, H, L, _ = q.shape
    out_THA, lse_HT = documents_forward(
        _fold(q), _fold(k), _fold(v), diagonal.bounds, diagonal.cu_seqlens, diagonal.max_len, scale
    )
    acc.add(slice(None), out_THA.view(B, L, H, -1).transpose(1, 2), lse_HT.view(H, B, L).transpose(0, 1))


def diagonal_backward(dout, q, k, v, out, lse, diagonal: Diagonal, scale: float):
    """The Diagonal's share of dq, dk, dv ([B, *, L, *], the rank's own tokens) given the merged
    out and lse [B, H, L]."""
    B, H, L, _ = q.shape
    grads = documents_backward(
        _fold(dout), _fold(q), _fold(k), _fold(v), _fold(out), lse.transpose(0, 1).reshape(H, B * L),
        diagonal.bounds, diagonal.cu_seqlens, diagonal.max_len, scale,
    )  # fmt: skip
    return tuple(g.view(B, L, g.shape[1], -1).transpose(1, 2) for g in grads)
