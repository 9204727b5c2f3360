"""Pieces every plait model shares."""

import torch
import torch.nn.functional as F
from torch import nn


class ScaledDotProductAttention(nn.Module):
    """Causal attention over [B, H, S, D] tensors with equal q and kv head counts.

    A model calls attention only through this module, so context parallel can swap in ring or
    all-to-all attention without touching the model.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(self, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=self.scale)


def repeat_kv(x_BSHD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat kv heads so grouped-query attention looks like multi-head attention to SDPA."""
    if n_rep == 1:
        return x_BSHD
    B, S, H, D = x_BSHD.shape
    return x_BSHD[:, :, :, None, :].expand(B, S, H, n_rep, D).reshape(B, S, H * n_rep, D)
