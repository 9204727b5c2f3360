"""Llama 3's RoPE tables, with Llama 3.1's frequency scaling; Qwen3 builds its tables here too.

Tables are built for `max_seq_len` positions; the rotation and the lookup by position
(`apply_rope`, `rope_at`, re-exported here) are every model's: plait.models.rope.
"""

import math

import torch

from plait.models.llama3.args import RopeScaling
from plait.models.rope import apply_rope, rope_at

__all__ = ["apply_rope", "rope_at", "rope_frequencies", "rope_tables"]


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
