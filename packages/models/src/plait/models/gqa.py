"""Grouped-query attention with rotary positions: Llama 3's, and Qwen3's with QK-norm.

n_heads query heads share n_kv_heads key/value heads. Shapes are inferred from tensors, so tensor
parallel's local head counts work unchanged.
"""

import torch
from torch import nn

from plait.models.common import INIT_STD, ScaledDotProductAttention
from plait.models.cpu_bf16 import Linear
from plait.models.rope import apply_rope


class GroupedQueryAttention(nn.Module):
    """`qk_norm` (Qwen3): `q_norm` / `k_norm`, an RMSNorm over each head's head_dim applied to the
    queries and keys before RoPE (it keeps the attention logits from growing)."""

    def __init__(self, args, qk_norm: bool = False):
        super().__init__()
        self.head_dim = args.head_dim
        self.qk_norm = qk_norm
        self.wq = Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if qk_norm:
            # One weight of head_dim shared by every head (tensor parallel: `head_norm`).
            self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        # The one place attention is computed; context parallel replaces this module.
        self.sdpa = ScaledDotProductAttention()

    def forward(
        self, x_BSD: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # Head counts are inferred (-1), so tensor parallel's local heads work unchanged.
        q_BSHA = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        q_BSHA = self.q_norm(q_BSHA) if self.qk_norm else q_BSHA
        k_BSGA = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        k_BSGA = self.k_norm(k_BSGA) if self.qk_norm else k_BSGA
        v_BSGA = self.wv(x_BSD).view(B, S, -1, self.head_dim)

        # Normalised, then rotated, as Qwen3's released weights were trained (the norm's weight
        # scales the two members of a rotary pair separately, so the order matters).
        q_BSHA = apply_rope(q_BSHA, rope_cos, rope_sin)
        k_BSGA = apply_rope(k_BSGA, rope_cos, rope_sin)

        # G kv heads go to the sdpa module as they are: the kernels do grouped-query attention
        # natively, without copying K/V up to H heads.
        # Causal calls keep the 3-argument sdpa contract; the document mask adds its positions
        # and their offsets in the folded tokens.
        documents = () if document_positions_BS is None else (document_positions_BS, document_offsets)
        out_BHSA = self.sdpa(q_BSHA.transpose(1, 2), k_BSGA.transpose(1, 2), v_BSGA.transpose(1, 2), *documents)
        return self.wo(out_BHSA.transpose(1, 2).reshape(B, S, -1))

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_proj_std)
        if self.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
