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
from plait.models.documents import attention_inputs, offsets_of
from plait.models.llama3.rope import apply_rope, rope_at, rope_tables
from plait.models.moe import MoE, TokenChoiceTopKRouter
from plait.models.qwen3.args import ModelArgs
from plait.models.qwen3.plan import parallel_info, param_counts


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


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then a SwiGLU (`feed_forward`) or an MoE (`moe`)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe:
            self.moe = build_moe(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
        # Output projections add into the residual stream; scaling their std by depth keeps the
        # stream's variance from growing with the number of blocks.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_init_std = INIT_STD / (2 * depth) ** 0.5

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def forward(
        self, x_BSD: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), rope_cos, rope_sin, document_positions_BS, document_offsets)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h_BSD + ffn(self.ffn_norm(h_BSD))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
        self.attention.init_weights(self.out_proj_init_std)
        (self.moe if self.is_moe else self.feed_forward).init_weights(self.out_proj_init_std)


class Transformer(nn.Module):
    """Token embedding -> n_layers blocks -> RMSNorm -> output projection to vocabulary logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict "0".."n-1": module paths stay stable when pipeline parallel drops layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        self._tie_embeddings()
        # Non-persistent: derived from args; init_weights recomputes them after a meta build.
        rope_cos_LK, rope_sin_LK = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, None)
        self.register_buffer("rope_cos", rope_cos_LK, persistent=False)
        self.register_buffer("rope_sin", rope_sin_LK, persistent=False)

    def _tie_embeddings(self) -> None:
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # Moving off the meta device (to_empty) gives each module its own new Parameter, which
        # silently unties a shared weight; tie it again after every conversion.
        module = super()._apply(fn, recurse)
        self._tie_embeddings()
        return module

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] int64, positions [S] or [B, S] int64, document_positions [B, S] int32 of the
        full rows (plait.models.documents; needed by attention_mask / rope_positions = "document")
        -> logits [B, S, V]. The argument names are the contract of docs/contracts.md."""
        # A pipeline stage without the embedding receives hidden states [B, S, D] instead of tokens.
        h_BSD = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        positions, mask_positions_BS = attention_inputs(
            self.args.attention_mask, self.args.rope_positions, tokens, positions, document_positions
        )
        # Built once for every layer, outside the compiled blocks.
        mask_offsets = None if mask_positions_BS is None else offsets_of(mask_positions_BS)
        rope_cos, rope_sin = rope_at(self.rope_cos, self.rope_sin, positions)
        for layer in self.layers.values():
            h_BSD = layer(h_BSD, rope_cos, rope_sin, mask_positions_BS, mask_offsets)
        h_BSD = self.norm(h_BSD) if self.norm is not None else h_BSD
        return self.output(h_BSD) if self.output is not None else h_BSD

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter exactly once, recompute the RoPE tables, zero router state.

        Call after building on the meta device and `to_empty(device=...)`; works on DTensor
        parameters. `buffer_device` places the RoPE tables.
        """
        buffer_device = buffer_device if buffer_device is not None else self.rope_cos.device
        args = self.args
        with torch.device(buffer_device):
            self.rope_cos, self.rope_sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, None)
        # Tied: the one matrix takes the output init (the logit scale matters at step 0; the first
        # RMSNorm normalises the embedding's scale away).
        if self.tok_embeddings is not None and not args.tie_embeddings:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
        if self.output is not None:
            std = args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

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
