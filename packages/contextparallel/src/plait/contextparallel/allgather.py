"""All-gather context parallel (pass-KV): every rank gathers K and V once per layer.

Forward: all-gather K and V (one collective; each comes out contiguous), reorder the chunks to
sequence order, attend the local queries to the keys each one may see (layout.plan_blocks, or with
documents documents.plan_document_blocks), merge through the lse.
Backward: gather again (only the local K/V are saved, so activation memory stays O(S / cp)),
accumulate dK/dV for the whole sequence in fp32, reduce-scatter them back to their owners.
"""

import torch
import torch.distributed as dist

from .blockwise import Diagonal, blocks_backward, blocks_forward, diagonal_backward, diagonal_forward, plan
from .comm import all_gather, pack, reduce_scatter, unpack
from .kernels import MergedAttention, accum_dtype, last_dim_contiguous
from .layout import SequenceLayout


def _gather_kv(k_BGLD: torch.Tensor, v_BGLF: torch.Tensor, group, layout: SequenceLayout):
    """Local k [B, G, L, D], v [B, G, L, F] (L = chunks_per_rank x c) -> the whole sequence [B, G, S, *], natural order, each
    contiguous (gathered in one collective)."""
    gathered_RN = all_gather(pack(k_BGLD, v_BGLF), group, layout.cp)
    return unpack_gathered(gathered_RN, k_BGLD.shape, v_BGLF.shape, layout)


def unpack_gathered(gathered_RN: torch.Tensor, k_shape, v_shape, layout: SequenceLayout):
    """Every rank's packed [K | V] (rank-major [R, n]) -> the whole K and V in sequence order."""
    k_RBGLD, v_RBGLF = unpack(gathered_RN, (k_shape, v_shape))
    return _natural(k_RBGLD, layout), _natural(v_RBGLF, layout)


def _natural(x_RBGLF: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    R, B, G, L, F = x_RBGLF.shape
    slots_BGNcF = x_RBGLF.movedim(0, 2).reshape(B, G, layout.n_chunks, L // layout.chunks_per_rank, F)
    return slots_BGNcF.index_select(2, layout.natural_order_index(x_RBGLF.device)).view(B, G, R * L, F)


def _scatter_grad(dkv_BGSF: torch.Tensor, group, layout: SequenceLayout) -> torch.Tensor:
    """Whole-sequence fp32 [B, G, S, F] summed over ranks -> this rank's [B, G, L, F]."""
    return reduce_scatter(rank_major(dkv_BGSF, layout), group)


def rank_major(x_BGSF: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Whole sequence [B, G, S, F] -> every rank's tokens [R, B, G, L, F] (what a reduce-scatter splits)."""
    B, G, S, F = x_BGSF.shape
    c = S // layout.n_chunks
    slots = x_BGSF.view(B, G, layout.n_chunks, c, F).index_select(2, layout.rank_order_index(x_BGSF.device))
    return slots.view(B, G, layout.cp, layout.chunks_per_rank * c, F).movedim(2, 0)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout: SequenceLayout, scale: float, segments=None):
        rank = dist.get_rank(group)
        q = last_dim_contiguous(q)
        k_full, v_full = _gather_kv(k, v, group, layout)
        chunk = q.shape[2] // layout.chunks_per_rank
        # segments (documents.DocumentSegments) or None (causal): the blocks and their unit in tokens.
        blocks, unit = plan(layout.chunks(rank), range(layout.n_chunks), chunk, segments)
        acc = MergedAttention(q, v.shape[-1])
        diagonal = None
        if segments is not None:  # the documents' causal squares: one call on the rank's own K/V
            key = (tuple(layout.chunks(rank)), "all", chunk)
            diagonal, blocks = Diagonal.split(segments, blocks, q.shape, key, q.device)
            if diagonal is not None:
                diagonal_forward(acc, q, k, v, diagonal, scale)
        blocks_forward(acc, q, k_full, v_full, blocks, unit, scale)
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.group, ctx.layout, ctx.scale, ctx.blocks, ctx.unit = group, layout, scale, blocks, unit
        ctx.diagonal = diagonal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        d = k.shape[-1]
        k_full, v_full = _gather_kv(k, v, ctx.group, ctx.layout)
        dq = torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
        # One fp32 [dK | dV] accumulator (the kernels never read it): one reduce-scatter for both.
        B, G, S, _ = k_full.shape
        dkv = torch.zeros(B, G, S, d + v.shape[-1], dtype=accum_dtype(q.dtype), device=q.device)
        blocks_backward(
            dq, dkv[..., :d], dkv[..., d:], dout.contiguous(), q, k_full, v_full, out, lse,
            ctx.blocks, ctx.unit, ctx.scale,
        )
        dkv_local = _scatter_grad(dkv, ctx.group, ctx.layout)
        if ctx.diagonal is not None:  # the rank's own tokens: added after they came home
            dq_d, dk_d, dv_d = diagonal_backward(dout, q, k, v, out, lse, ctx.diagonal, ctx.scale)
            dq += dq_d
            dkv_local[..., :d] += dk_d
            dkv_local[..., d:] += dv_d
        return dq.to(q.dtype), dkv_local[..., :d].to(k.dtype), dkv_local[..., d:].to(v.dtype), None, None, None, None
