"""Llama 3 (Grattafiori et al., 2024): a pre-norm decoder-only transformer with grouped-query
attention, SwiGLU feed-forward layers, RMSNorm and rotary position embeddings.

Plain single-device PyTorch. Parallelism is applied from outside using the data that
`Transformer.parallel_info()` returns (see docs/contracts.md); nothing here knows about it,
except that shapes are inferred from tensors (e.g. the local head count under tensor parallel).
"""

import torch

from plait.models import metadata
from plait.models.common import FeedForward
from plait.models.decoder import Decoder, PreNormBlock
from plait.models.gqa import GroupedQueryAttention
from plait.models.llama3.args import ModelArgs
from plait.models.llama3.rope import rope_tables


class Attention(GroupedQueryAttention):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads (plait.models.gqa)."""


class TransformerBlock(PreNormBlock):
    """x + attention(norm(x)), then + feed_forward(norm(.)): pre-norm residual block."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__(layer_id, args, Attention(args), FeedForward(args.dim, args.ffn_hidden_dim))
        self.layer_id = layer_id


class Transformer(Decoder):
    """Token embedding -> n_layers blocks -> RMSNorm -> output projection to vocabulary logits
    (plait.models.decoder), with Llama 3.1's scaled RoPE."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: TransformerBlock(i, args), tie_embeddings=args.tie_embeddings)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        args = self.args
        return rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)

    def parallel_info(self) -> dict:
        """Blocks, tensor-parallel plan and CP metadata as plain data (docs/contracts.md)."""
        args = self.args
        n_kv_heads = args.n_kv_heads or args.n_heads
        return metadata.parallel_info(
            [f"layers.{name}" for name in self.layers],
            {**metadata.EDGE_PLAN, **metadata.attention_plan(metadata.GQA_PROJECTIONS), **metadata.DENSE_FFN_PLAN},
            experts=[],
            heads=(args.n_heads, n_kv_heads, args.head_dim),
            tp_divisible={"n_heads": args.n_heads, "n_kv_heads": n_kv_heads, "ffn_hidden": args.ffn_hidden_dim,
                          "vocab_size": args.vocab_size},
            tied=args.tie_embeddings,
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x non-embedding params + 12 * L * H * head_dim * seq_len.

        The torchtitan convention (causal attention not halved). Counted from args rather than
        from parameters so sharding or deleted pipeline stages do not change it. The output
        projection counts as a matmul even when tied to the embedding; the embedding lookup does not.
        """
        args = self.args
        attention = 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.n_kv_heads * args.head_dim
        feed_forward = 3 * args.dim * args.ffn_hidden_dim
        norms = 2 * args.dim
        non_embedding = args.n_layers * (attention + feed_forward + norms) + args.dim + args.dim * args.vocab_size
        return 6 * non_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
