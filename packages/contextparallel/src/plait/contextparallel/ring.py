"""Ring context parallel: K/V blocks travel around the cp ranks, one hop per step.

Forward, step s: rank r holds the K/V of rank r - s, starts sending it on to r + 1 (and receiving
the next) with batch_isend_irecv, then attends its queries to the block it holds, so the transfer
overlaps the attention. Only two K/V blocks are alive at once: memory stays O(S / cp).
Backward: the K/V travel the same way, and each block's dK/dV accumulator (fp32) travels with
it, every rank adding its share; one last hop returns it to the block's owner.
With load balancing every step costs the same on every rank (half of the blocks are masked and
never computed); without it rank r computes only the steps that bring earlier chunks.
"""

import torch
import torch.distributed as dist

from .blockwise import Diagonal, blocks_backward, blocks_forward, diagonal_backward, diagonal_forward, plan
from .comm import GRAD_TAG, KV_TAG, RingShift, pack, unpack
from .kernels import MergedAttention, accum_dtype, last_dim_contiguous
from .layout import SequenceLayout


def _plans(layout: SequenceLayout, rank: int, chunk: int = 1, segments=None):
    """The blocks of each step: the K/V held at step s came from rank - s. Causal plans are in chunk
    units; with `segments` (documents.DocumentSegments) they are document plans in token units, and a
    step whose blocks are all masked computes nothing (its K/V and dK/dV still pass on)."""
    return [plan(layout.chunks(rank), layout.chunks((rank - s) % layout.cp), chunk, segments)[0] for s in range(layout.cp)]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout: SequenceLayout, scale: float, segments=None):
        rank = dist.get_rank(group)
        q = last_dim_contiguous(q)
        chunk = q.shape[2] // layout.chunks_per_rank
        shift = RingShift(group, KV_TAG)
        plans = _plans(layout, rank, chunk, segments)
        unit = chunk if segments is None else 1
        acc = MergedAttention(q, v.shape[-1])
        diagonal = None
        if segments is not None:  # step 0 holds the rank's own K/V: its causal squares in one call
            key = (tuple(layout.chunks(rank)), "own", chunk)
            diagonal, plans[0] = Diagonal.split(segments, plans[0], q.shape, key, q.device)
            if diagonal is not None:
                diagonal_forward(acc, q, k, v, diagonal, scale)
        kv = pack(k, v)  # flat [K | V]: one message per hop, K and V contiguous views of it
        for step, blocks in enumerate(plans):
            pending = shift.start(kv) if step + 1 < layout.cp else None
            blocks_forward(acc, q, *unpack(kv, (k.shape, v.shape)), blocks, unit, scale)
            if pending is not None:
                kv = pending.wait()
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.group, ctx.layout, ctx.scale, ctx.plans, ctx.unit = group, layout, scale, plans, unit
        ctx.diagonal = diagonal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        d = k.shape[-1]
        dout = dout.contiguous()
        kv_shift, grad_shift = RingShift(ctx.group, KV_TAG), RingShift(ctx.group, GRAD_TAG)
        dq = torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
        kv = pack(k, v)
        grad_pending = None
        for step, blocks in enumerate(ctx.plans):
            kv_pending = kv_shift.start(kv) if step + 1 < ctx.layout.cp else None
            # The block's fp32 [dK | dV] accumulator travels as one message (the kernels never read it).
            dkv = torch.zeros((*k.shape[:-1], d + v.shape[-1]), dtype=accum_dtype(q.dtype), device=q.device)
            blocks_backward(
                dq, dkv[..., :d], dkv[..., d:], dout, q, *unpack(kv, (k.shape, v.shape)), out, lse, blocks, ctx.unit,
                ctx.scale,
            )
            if step == 0 and ctx.diagonal is not None:  # the own block's accumulator, before it leaves
                dq_d, dk_d, dv_d = diagonal_backward(dout, q, k, v, out, lse, ctx.diagonal, ctx.scale)
                dq += dq_d
                dkv[..., :d] += dk_d
                dkv[..., d:] += dv_d
            if grad_pending is not None:
                dkv += grad_pending.wait()  # what the ranks before this one added to this block
            if ctx.layout.cp > 1:  # on to the next holder; after the last step, home (cp 1: home already)
                grad_pending = grad_shift.start(dkv)
            if kv_pending is not None:
                kv = kv_pending.wait()
        if grad_pending is not None:
            dkv = grad_pending.wait()
        return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), None, None, None, None
