"""YaRN-scaled RoPE tables for the decoupled rotary part of MLA.

Only the `qk_rope_head_dim` slice of each query/key is rotated. Pairs are interleaved
(x[2i], x[2i+1]) as in DeepSeek's reference and HF's `rope_interleave=True`, so released
checkpoints load without permuting rows; rotation and table lookup are Llama's
(`plait.models.llama3.rope.apply_rope` / `rope_at`).
"""

import math

import torch

from plait.models.deepseek_v3.args import ModelArgs


def _correction_dim(num_rotations: float, dim: int, base: float, seq_len: int) -> float:
    """The rotary pair index whose wavelength fits `num_rotations` times into `seq_len`."""
    return dim * math.log(seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(args: ModelArgs) -> torch.Tensor:
    """Angular frequency of each rotated pair, [qk_rope_head_dim // 2], float32.

    YaRN (Peng et al., 2023): pairs that rotate many times within the original context keep
    their frequency, pairs that rotate less than once are interpolated (divided by
    `rope_factor`), with a linear ramp between `beta_fast` and `beta_slow` rotations.
    """
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs_K = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not args.uses_yarn:
        return freqs_K
    low = max(math.floor(_correction_dim(args.beta_fast, dim, base, args.original_seq_len)), 0)
    high = min(math.ceil(_correction_dim(args.beta_slow, dim, base, args.original_seq_len)), dim - 1)
    ramp_K = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep_K = 1 - ramp_K  # 1: keep the original frequency (extrapolate), 0: interpolate
    return freqs_K / args.rope_factor * (1 - keep_K) + freqs_K * keep_K


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale^2 when YaRN is on (longer context, sharper softmax)."""
    scale = args.qk_head_dim**-0.5
    if args.uses_yarn:
        mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each [max_seq_len, qk_rope_head_dim // 2], float32."""
    angles_LK = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), yarn_frequencies(args))
    return angles_LK.cos(), angles_LK.sin()
