"""Rotary position embeddings, real-valued and indexed by explicit positions: the rotation and the
table lookup every plait model applies (each model builds its own tables: Llama's 3.1 scaling in
llama3/rope.py, DeepSeek's YaRN in deepseek_v3/rope.py, plain RoPE for Qwen3).

Meta's reference code rotates adjacent pairs (x[2i], x[2i+1]) as complex numbers. We keep that
interleaved layout but store cos and sin as real tables: complex tensors are awkward under DTensor
and torch.compile. HF checkpoints of Llama and Qwen use the rotate-half layout instead; their HF
adapters permute the rows of wq and wk so both give the same attention scores.

Tables are gathered by position index, so context parallel can feed any (e.g. load-balanced,
non-contiguous) subset of positions.
"""

import torch


def rope_at(cos_LK: torch.Tensor, sin_LK: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the tables at `positions` ([S] or [B, S]) into shapes that broadcast over [B, S, H, K]."""
    # [S] -> [S, 1, K]; [B, S] -> [B, S, 1, K]: the singleton is the head axis.
    return cos_LK[positions].unsqueeze(-2), sin_LK[positions].unsqueeze(-2)


def apply_rope(x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of every head by its position's angle:
    (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin)."""
    # Rotate in float32 like the reference: bf16 angles lose the precision long contexts need.
    x_BSHK2 = x_BSHD.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x_BSHK2.unbind(-1)
    # As x * cos + (-x[2i+1], x[2i]) * sin over both halves of a pair at once: 5 kernels forward
    # and 5 backward instead of 7 and 10 (each a launch on a GPU, per call, two calls per layer),
    # and the same floats: x*cos + (-y)*sin is x*cos - y*sin exactly, and a sum of two terms is the
    # same in either order (forward and backward).
    swapped_BSHK2 = torch.stack((-x_odd, x_even), dim=-1)
    rotated_BSHK2 = x_BSHK2 * cos[..., None] + swapped_BSHK2 * sin[..., None]
    return rotated_BSHK2.flatten(-2).type_as(x_BSHD)
