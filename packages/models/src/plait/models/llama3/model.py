"""Llama 3 (Grattafiori et al., 2024): a pre-norm decoder-only transformer with grouped-query
attention, SwiGLU feed-forward layers, RMSNorm and rotary position embeddings.

Plain single-device PyTorch. Parallelism is applied from outside using the data that
`Transformer.parallel_info()` returns (see docs/contracts.md); nothing here knows about it,
except that shapes are inferred from tensors (e.g. the local head count under tensor parallel).
"""

import torch
from torch import nn

from plait.models.common import INIT_STD, FeedForward, ScaledDotProductAttention
from plait.models.cpu_bf16 import Linear
from plait.models.documents import attention_inputs, offsets_of
from plait.models.llama3.args import ModelArgs
from plait.models.llama3.rope import apply_rope, rope_at, rope_tables

# INIT_STD (common.py) is the std of the projections that read the residual stream (torchtitan's
# scheme). Like torchtitan we keep trunc_normal_'s default cutoffs of +-2 (absolute), which at this
# std truncate nothing.

class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # The one place attention is computed; context parallel replaces this module.
        self.sdpa = ScaledDotProductAttention()

    def forward(
        self, x_BSD: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # Head counts are inferred (-1), so tensor parallel's local heads work unchanged.
        q_BSHD = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k_BSGD = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v_BSGD = self.wv(x_BSD).view(B, S, -1, self.head_dim)

        q_BSHD = apply_rope(q_BSHD, rope_cos, rope_sin)
        k_BSGD = apply_rope(k_BSGD, rope_cos, rope_sin)

        # G kv heads go to the sdpa module as they are: the kernels do grouped-query attention
        # natively, without copying K/V up to H heads.
        # Causal calls keep the 3-argument sdpa contract; the document mask adds its positions
        # and their offsets in the folded tokens.
        documents = () if document_positions_BS is None else (document_positions_BS, document_offsets)
        out_BHSD = self.sdpa(
            q_BSHD.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2), *documents
        )
        out_BSE = out_BHSD.transpose(1, 2).reshape(B, S, -1)
        return self.wo(out_BSE)

    def init_weights(self, out_proj_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_proj_std)


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then + feed_forward(norm(.)): pre-norm residual block."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Output projections add into the residual stream; scaling their std by depth keeps the
        # stream's variance from growing with the number of blocks.
        if args.depth_init:
            self.out_proj_init_std = INIT_STD / (2 * (layer_id + 1)) ** 0.5
        else:
            self.out_proj_init_std = INIT_STD / (2 * args.n_layers) ** 0.5

    def forward(
        self, x_BSD: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), rope_cos, rope_sin, document_positions_BS, document_offsets)
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD))

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
        self.attention.init_weights(self.out_proj_init_std)
        self.feed_forward.init_weights(self.out_proj_init_std)


class Transformer(nn.Module):
    """Token embedding -> n_layers blocks -> RMSNorm -> output projection to vocabulary logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" keeps module paths `layers.0`, ... stable when pipeline
        # parallel deletes some layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        self._tie_embeddings()
        # Non-persistent: derived from args, never checkpointed; init_weights recomputes them after
        # a meta-device build.
        rope_cos_LK, rope_sin_LK = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.register_buffer("rope_cos", rope_cos_LK, persistent=False)
        self.register_buffer("rope_sin", rope_sin_LK, persistent=False)

    def _tie_embeddings(self):
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
        -> logits [B, S, V]. positions default: arange(S), or the document positions.

        The argument names are part of the contract (docs/contracts.md): the trainer passes
        `document_positions` by name, and context parallel shards `tokens` and `positions`.
        """
        # A pipeline stage without the embedding receives hidden states [B, S, D] instead of tokens.
        h_BSD = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        positions, mask_positions_BS = attention_inputs(
            self.args.attention_mask, self.args.rope_positions, tokens, positions, document_positions
        )
        # Built once for every layer, outside the compiled blocks (a host read in eager code, or
        # the offsets the trainer moved with the positions).
        mask_offsets = None if mask_positions_BS is None else offsets_of(mask_positions_BS)
        rope_cos, rope_sin = rope_at(self.rope_cos, self.rope_sin, positions)
        for layer in self.layers.values():
            h_BSD = layer(h_BSD, rope_cos, rope_sin, mask_positions_BS, mask_offsets)
        h_BSD = self.norm(h_BSD) if self.norm is not None else h_BSD
        return self.output(h_BSD) if self.output is not None else h_BSD

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None):
        """Initialise every parameter exactly once and recompute the RoPE tables.

        Call after building on the meta device and `to_empty(device=...)`; works on DTensor
        parameters (nn.init dispatches on them). `buffer_device` places the RoPE tables, e.g. on
        the GPU when the parameters were materialised on the CPU.
        """
        buffer_device = buffer_device if buffer_device is not None else self.rope_cos.device
        args = self.args
        with torch.device(buffer_device):
            self.rope_cos, self.rope_sin = rope_tables(
                args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
            )
        # Tied: one matrix serves both ends; it takes the output init because the logit scale
        # matters at step 0, while the embedding's scale is normalised away by the first RMSNorm.
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
        """Blocks, tensor-parallel plan and CP metadata as plain data (docs/contracts.md)."""
        blocks = [f"layers.{name}" for name in self.layers]
        return {
            "blocks": blocks,
            "tp_plan": {
                "tok_embeddings": "embedding_rowwise",
                "norm": "sequence_parallel",
                "output": "output_colwise",
                "layers.*.attention_norm": "sequence_parallel",
                "layers.*.attention": "prepare_input",
                "layers.*.attention.wq": "colwise",
                "layers.*.attention.wk": "colwise",
                "layers.*.attention.wv": "colwise",
                "layers.*.attention.wo": "rowwise",
                "layers.*.ffn_norm": "sequence_parallel",
                "layers.*.feed_forward": "prepare_input",
                "layers.*.feed_forward.w1": "colwise",
                "layers.*.feed_forward.w2": "rowwise",
                "layers.*.feed_forward.w3": "colwise",
            },
            "experts": [],
            "attention_modules": [f"{block}.attention.sdpa" for block in blocks],
            # FSDP units outside the blocks, in forward order: the embedding (resharded once used) and
            # the output head. A tied embedding is one weight in both: it stays with the root.
            "edge_units": [] if self.args.tie_embeddings else [["tok_embeddings"], ["norm", "output"]],
            # Head counts the attention modules see before tensor parallel (context parallel's
            # all-to-all splits heads over cp ranks).
            "attention_heads": {"n_heads": self.args.n_heads, "n_kv_heads": self.args.n_kv_heads or self.args.n_heads,
                                "head_dim": self.args.head_dim},
            # Sizes tensor parallel splits: heads and kv heads (whole heads per rank), FFN hidden, vocab.
            "tp_divisible": {
                "n_heads": self.args.n_heads,
                "n_kv_heads": self.args.n_kv_heads or self.args.n_heads,
                "ffn_hidden": self.args.ffn_hidden_dim,
                "vocab_size": self.args.vocab_size,
            },
        }

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
