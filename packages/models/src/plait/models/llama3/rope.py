"""Rotary position embeddings, real-valued and indexed by explicit positions.

Meta's reference code rotates adjacent pairs (x[2i], x[2i+1]) as complex numbers. We keep that
interleaved layout but store cos and sin as real tables: complex tensors are awkward under DTensor
and torch.compile. HF checkpoints use the rotate-half layout instead; the HF adapter permutes the
rows of wq and wk so both give the same attention scores.

Tables are built for `max_seq_len` positions and gathered by position index, so context parallel
can feed any (e.g. load-balanced, non-contiguous) subset of positions.
"""

import math

import torch

from plait.models.llama3.args import RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Angular frequency of each rotated pair, [head_dim // 2], float32."""
    freqs_K = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return freqs_K
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, interpolate between.
    wavelen_K = 2 * math.pi / freqs_K
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth_K = (scaling.original_max_seq_len / wavelen_K - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated_K = (1 - smooth_K) * freqs_K / scaling.factor + smooth_K * freqs_K
    scaled_K = torch.where(wavelen_K > low_freq_wavelen, freqs_K / scaling.factor, interpolated_K)
    return torch.where(wavelen_K < high_freq_wavelen, freqs_K, scaled_K)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each [max_seq_len, head_dim // 2], float32."""
    freqs_K = rope_frequencies(head_dim, theta, scaling)
    positions_L = torch.arange(max_seq_len, dtype=torch.float32)
    angles_LK = torch.outer(positions_L, freqs_K)
    return angles_LK.cos(), angles_LK.sin()


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
