"""Qwen3 (Qwen Team, 2025): Llama's pre-norm decoder with grouped-query attention whose queries and
keys are RMS-normalised per head before RoPE (QK-norm, in place of Qwen2's QKV biases: it keeps the
attention logits from growing, for stable training), and blocks that are either a SwiGLU (dense
Qwen3) or a mixture of experts with softmax top-k routing and no shared expert (Qwen3-MoE).

Plain single-device PyTorch. Parallelism is applied from outside using the data that
`Transformer.parallel_info()` returns (plan.py, docs/contracts.md); shapes are inferred from
tensors so tensor parallel's local heads and expert parallel's local experts work unchanged.
"""

import torch

from plait.models.common import FeedForward
from plait.models.decoder import Decoder, PreNormBlock, moe_block
from plait.models.gqa import GroupedQueryAttention
from plait.models.llama3.rope import rope_tables
from plait.models.moe import MoE
from plait.models.qwen3.args import ModelArgs
from plait.models.qwen3.plan import parallel_info, param_counts


class Attention(GroupedQueryAttention):
    """Grouped-query attention with `q_norm` / `k_norm`: RMSNorm over each head's head_dim (plait.models.gqa)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, qk_norm=True)


def build_moe(args: ModelArgs) -> MoE:
    """Qwen3-MoE's block: softmax over the routed experts, top-k, optionally renormalised, no shared expert."""
    return moe_block(args, score_func="softmax")


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
