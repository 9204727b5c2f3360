"""All-to-all (Ulysses) context parallel: trade sequence shards for head shards and back.

Forward: all-to-all q, k, v from [B, heads, S/cp, D] to [B, heads/cp, S, D] (chunks put back in
sequence order), one causal attention over the whole sequence on heads/cp heads (with documents:
one call for every document of every row, blockwise.Diagonal: one FlashAttention-2 varlen call on
CUDA, one flash call per document on the CPU), all-to-all the
output back. Backward mirrors it. Needs the (tensor-parallel local) query heads divisible by cp;
kv heads that are not are repeated to lcm(kv heads, cp) first (a copy of the local K/V only).
"""

import math

import torch

from .blockwise import Diagonal, diagonal_backward, diagonal_forward
from .comm import all_to_all
from .kernels import MergedAttention, attention_backward, attention_forward
from .layout import SequenceLayout


def seq_to_heads(x_BNLD: torch.Tensor, group, layout: SequenceLayout) -> torch.Tensor:
    """[B, N, L, D] sequence shard (L = chunks_per_rank x c) -> [B, N/cp, S, D] head shard, sequence in natural order."""
    return heads_from_ranks(all_to_all(heads_by_rank(x_BNLD, layout.cp), group), layout)


def heads_to_seq(y_BnSD: torch.Tensor, group, layout: SequenceLayout) -> torch.Tensor:
    """Inverse of seq_to_heads: [B, N/cp, S, D] -> [B, N, L, D]."""
    return seq_from_ranks(all_to_all(seq_by_rank(y_BnSD, layout), group))


# The all-to-alls' two sides, also used to simulate the ranks on one device (the GPU tests).
def heads_by_rank(x_BNLD: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, N, L, D] -> [cp, B, N/cp, L, D]: slice i (head group i) goes to rank i."""
    B, N, L, D = x_BNLD.shape
    return x_BNLD.unflatten(1, (cp, N // cp)).movedim(1, 0)


def heads_from_ranks(received_RBnLD: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """[cp (source rank), B, n, L, D] -> [B, n, S, D], sequence in natural order."""
    R, B, n, L, D = received_RBnLD.shape
    slots = received_RBnLD.movedim(0, 2).reshape(B, n, layout.n_chunks, L // layout.chunks_per_rank, D)
    return slots.index_select(2, layout.natural_order_index(received_RBnLD.device)).view(B, n, R * L, D)


def seq_by_rank(y_BnSD: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """[B, n, S, D] -> [cp, B, n, L, D]: slice i (rank i's tokens) goes to rank i."""
    B, n, S, D = y_BnSD.shape
    cp, c = layout.cp, S // layout.n_chunks
    slots = y_BnSD.view(B, n, layout.n_chunks, c, D).index_select(2, layout.rank_order_index(y_BnSD.device))
    return slots.view(B, n, cp, layout.chunks_per_rank * c, D).movedim(2, 0)


def seq_from_ranks(received_RBnLD: torch.Tensor) -> torch.Tensor:
    """[cp (head group), B, n, L, D] -> [B, cp * n, L, D]."""
    R, B, n, L, D = received_RBnLD.shape
    return received_RBnLD.movedim(0, 1).reshape(B, R * n, L, D)


def kv_repeats(n_kv_heads: int, cp: int) -> int:
    """How many times to repeat each kv head so cp divides the kv head count."""
    return cp // math.gcd(n_kv_heads, cp)


class UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout: SequenceLayout, scale: float, segments=None):
        repeats = kv_repeats(k.shape[1], layout.cp)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        q_h, k_h, v_h = (seq_to_heads(t, group, layout) for t in (q, k, v))
        # The whole sequence is here: with documents, the one causal square refined per segment.
        chunk = q.shape[2] // layout.chunks_per_rank
        diagonal = None
        if segments is not None:  # every block of the whole-sequence plan is a causal square
            every = range(layout.n_chunks)
            blocks = segments.plan(every, every, chunk)
            diagonal, _ = Diagonal.split(segments, blocks, q_h.shape, (tuple(every), "ulysses", chunk), q_h.device)
        if diagonal is None:
            out_h, lse_h = attention_forward(q_h, k_h, v_h, True, scale)
        else:
            acc = MergedAttention(q_h, v_h.shape[-1])
            diagonal_forward(acc, q_h, k_h, v_h, diagonal, scale)
            out_h, lse_h = acc.out.to(q_h.dtype), acc.lse
        ctx.save_for_backward(q_h, k_h, v_h, out_h, lse_h)
        ctx.group, ctx.layout, ctx.scale, ctx.repeats, ctx.diagonal = group, layout, scale, repeats, diagonal
        return heads_to_seq(out_h, group, layout)

    @staticmethod
    def backward(ctx, dout):
        q_h, k_h, v_h, out_h, lse_h = ctx.saved_tensors
        dout_h = seq_to_heads(dout.contiguous(), ctx.group, ctx.layout)
        if ctx.diagonal is None:
            dq_h, dk_h, dv_h = attention_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, True, ctx.scale)
        else:
            dq_h, dk_h, dv_h = diagonal_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, ctx.diagonal, ctx.scale)
            dq_h, dk_h, dv_h = (g.contiguous() for g in (dq_h, dk_h, dv_h))
        dq, dk, dv = (heads_to_seq(t, ctx.group, ctx.layout) for t in (dq_h, dk_h, dv_h))
        if ctx.repeats > 1:
            B, G, L, _ = dk.shape
            dk = dk.view(B, G // ctx.repeats, ctx.repeats, L, -1).sum(2)
            dv = dv.view(B, G // ctx.repeats, ctx.repeats, L, -1).sum(2)
        return dq, dk, dv, None, None, None, None
