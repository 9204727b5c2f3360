"""Qwen3 (Qwen Team, 2025): Llama's pre-norm decoder with grouped-query attention whose queries and
keys are RMS-normalised per head before RoPE (QK-norm, in place of Qwen2's QKV biases: it keeps the
attention logits from growing, for stable training), and blocks that are either a SwiGLU (dense
Qwen3) or a mixture of experts with softmax top-k routing and no shared expert (Qwen3-MoE).

Plain single-device PyTorch. Parallelism is applied from outside using the data that
`Transformer.parallel_info()` returns (plan.py, docs/contracts.md); shapes are inferred from
tensors so tensor parallel's local heads and expert parallel's local experts work unchanged.
"""

import torch
from torch import nn

from plait.models.common import INIT_STD, FeedForward, ScaledDotProductAttention
from plait.models.cpu_bf16 import Linear
from plait.models.decoder import Decoder, PreNormBlock
from plait.models.llama3.rope import rope_tables
from plait.models.moe import MoE, TokenChoiceTopKRouter
from plait.models.qwen3.args import ModelArgs
from plait.models.qwen3.plan import parallel_info, param_counts
from plait.models.rope import apply_rope


class Attention(nn.Module):
    """Grouped-query attention with `q_norm` / `k_norm`: RMSNorm over each head's head_dim."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
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
        # Head counts inferred (-1): tensor parallel's local heads work unchanged.
        q_BSHA = self.q_norm(self.wq(x_BSD).view(B, S, -1, self.head_dim))
        k_BSGA = self.k_norm(self.wk(x_BSD).view(B, S, -1, self.head_dim))
        v_BSGA = self.wv(x_BSD).view(B, S, -1, self.head_dim)

        # Normalised, then rotated, as the released weights were trained (the norm's weight scales
        # the two members of a rotary pair separately, so the order matters).
        q_BSHA = apply_rope(q_BSHA, rope_cos, rope_sin)
        k_BSGA = apply_rope(k_BSGA, rope_cos, rope_sin)

        # G kv heads go to the kernels as they are (no copies up to H heads). Causal calls keep the
        # 3-argument sdpa contract; the document mask adds its positions and offsets.
        documents = () if document_positions_BS is None else (document_positions_BS, document_offsets)
        out_BHSA = self.sdpa(q_BSHA.transpose(1, 2), k_BSGA.transpose(1, 2), v_BSGA.transpose(1, 2), *documents)
        return self.wo(out_BHSA.transpose(1, 2).reshape(B, S, -1))

    def init_weights(self, out_proj_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_proj_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


def build_moe(args: ModelArgs) -> MoE:
    """Qwen3-MoE's block: softmax over the routed experts, top-k, optionally renormalised, no shared expert."""
    router = TokenChoiceTopKRouter(
        dim=args.dim,
        num_experts=args.n_routed_experts,
        top_k=args.n_activated_experts,
        score_func="softmax",
        route_norm=args.route_norm,
        aux_loss_coeff=args.aux_loss_coeff,
    )
    return MoE(args.dim, args.moe_inter_dim, args.n_routed_experts, 0, router, args.use_grouped_mm)


class TransformerBlock(PreNormBlock):
    """Pre-norm residual block: attention, then a SwiGLU (`feed_forward`) or an MoE (`moe`)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        attention = Attention(args)  # first: a seeded build draws its weights in this order
        ffn = build_moe(args) if args.is_moe else FeedForward(args.dim, args.inter_dim)
        super().__init__(layer_id, args, attention, ffn)


class Transformer(Decoder):
    """Token embedding -> n_layers blocks -> RMSNorm -> output projection to vocabulary logits
    (plait.models.decoder), with plain RoPE (no scaling in any release)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: TransformerBlock(i, args), tie_embeddings=args.tie_embeddings)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, None)

    def parallel_info(self) -> dict:
        """Blocks, tensor-parallel plan, experts and CP metadata as plain data (docs/contracts.md)."""
        return parallel_info(self.args, list(self.layers))

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, counted from args (plan.py)."""
        return param_counts(self.args)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active non-embedding params + 12 * L * H * head_dim * seq_len.

        The torchtitan convention (causal attention not halved); active counts the top-k routed
        experts, not all of them. The output projection counts as a matmul even when tied to the
        embedding; the embedding lookup does not. From args, so sharding or deleted pipeline stages
        do not change it.
        """
        a = self.args
        _, active = self.param_counts()
        non_embedding = active - (0 if a.tie_embeddings else a.vocab_size * a.dim)
        return 6 * non_embedding + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
