"""Attention over a plan of blocks (layout.plan_blocks): forward merges them, backward splits.

q, out and dout come with stride(-1) == 1, k and v dense (kernels.flash_input_problems): slices of
them along the sequence are what the kernels take, on CPU and CUDA alike.
"""

from collections.abc import Sequence

import torch

from .kernels import MergedAttention, attention_backward, attention_forward
from .layout import Block


def blocks_forward(acc: MergedAttention, q, k, v, blocks: Sequence[Block], chunk: int, scale: float) -> None:
    """Add every block of q against (k, v) into `acc` (slots of `chunk` tokens)."""
    for b in blocks:
        rows, keys = slice(b.q0 * chunk, b.q1 * chunk), slice(b.k0 * chunk, b.k1 * chunk)
        out, lse = attention_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], b.causal, scale)
        acc.add(rows, out, lse)


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
        rows, keys = slice(b.q0 * chunk, b.q1 * chunk), slice(b.k0 * chunk, b.k1 * chunk)
        # The kernels read the lse as a dense [B, H, Lq] (a strided slice is silently wrong on CUDA);
        # q, out, dout slices keep stride(-1) == 1, which is all the kernels need of them.
        dq, dk, dv = attention_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
            lse[:, :, rows].contiguous(), b.causal, scale,
        )
        dq_acc[:, :, rows] += dq
        dk_acc[:, :, keys] += dk
        dv_acc[:, :, keys] += dv
