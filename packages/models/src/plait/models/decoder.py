"""The decoder-only skeleton every plait model shares: token embedding -> pre-norm blocks -> RMSNorm
-> output head, with RoPE tables indexed by explicit positions.

A model (llama3, qwen3, deepseek_v3) subclasses `Decoder` with its blocks and its RoPE tables, and
`PreNormBlock` with its attention and feed-forward; what is left in its files is what differs.
Module paths are the contract the parallel packages, checkpoints and HF adapters read:
`tok_embeddings`, `layers.{i}.attention` / `.feed_forward` / `.moe`, `norm`, `output`.
"""

from collections.abc import Callable

import torch
from torch import nn

from plait.models.common import INIT_STD
from plait.models.cpu_bf16 import Linear
from plait.models.documents import attention_inputs, offsets_of
from plait.models.moe import MoE, TokenChoiceTopKRouter
from plait.models.rope import rope_at


def moe_block(args, n_shared_experts: int = 0, **router_options) -> MoE:
    """An MoE block from a model's args (dim, n_routed_experts, n_activated_experts, moe_inter_dim,
    route_norm, aux_loss_coeff, use_grouped_mm): `n_shared_experts` shared experts, and the
    router's scoring and grouping as `router_options` (plait.models.moe.TokenChoiceTopKRouter)."""
    router = TokenChoiceTopKRouter(
        dim=args.dim,
        num_experts=args.n_routed_experts,
        top_k=args.n_activated_experts,
        route_norm=args.route_norm,
        aux_loss_coeff=args.aux_loss_coeff,
        **router_options,
    )
    return MoE(args.dim, args.moe_inter_dim, args.n_routed_experts, n_shared_experts, router, args.use_grouped_mm)


class PreNormBlock(nn.Module):
    """x + attention(attention_norm(x)), then + ffn(ffn_norm(.)): a pre-norm residual block whose
    ffn is a SwiGLU (registered as `feed_forward`) or a mixture of experts (`moe`)."""

    def __init__(self, layer_id: int, args, attention: nn.Module, ffn: nn.Module):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if isinstance(ffn, MoE):
            self.moe = ffn
        else:
            self.feed_forward = ffn
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


class Decoder(nn.Module):
    """Token embedding -> n_layers blocks -> RMSNorm -> output projection to vocabulary logits.

    `block(i)` builds layer i; a subclass gives `_rope_tables()` (cos, sin [max_seq_len, K]).
    Pipeline parallel deletes layers and sets `tok_embeddings`, `norm` or `output` to None: each
    step below checks for it.
    """

    def __init__(self, args, block: Callable[[int], nn.Module], tie_embeddings: bool = False):
        super().__init__()
        self.args = args
        self.tie_embeddings = tie_embeddings
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" keeps module paths `layers.0`, ... stable when pipeline
        # parallel deletes some layers.
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        self._tie_embeddings()
        # Non-persistent: derived from args, never checkpointed; init_weights recomputes them after
        # a meta-device build.
        rope_cos_LK, rope_sin_LK = self._rope_tables()
        self.register_buffer("rope_cos", rope_cos_LK, persistent=False)
        self.register_buffer("rope_sin", rope_sin_LK, persistent=False)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _tie_embeddings(self) -> None:
        if self.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
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
        block_inputs = self._block_inputs(tokens, positions, document_positions)
        for layer in self.layers.values():
            h_BSD = layer(h_BSD, *block_inputs)
        h_BSD = self.norm(h_BSD) if self.norm is not None else h_BSD
        return self.output(h_BSD) if self.output is not None else h_BSD

    def _block_inputs(self, tokens, positions, document_positions) -> tuple:
        """What every block takes after the hidden state: (rope_cos, rope_sin, the document
        positions of the mask or None, their offsets or None)."""
        positions, mask_positions_BS = attention_inputs(
            self.args.attention_mask, self.args.rope_positions, tokens, positions, document_positions
        )
        # Built once for every layer, outside the compiled blocks (a host read in eager code, or
        # the offsets the trainer moved with the positions).
        mask_offsets = None if mask_positions_BS is None else offsets_of(mask_positions_BS)
        rope_cos, rope_sin = rope_at(self.rope_cos, self.rope_sin, positions)
        return rope_cos, rope_sin, mask_positions_BS, mask_offsets

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter exactly once and recompute the RoPE tables (MoE blocks also
        zero their router state).

        Call after building on the meta device and `to_empty(device=...)`; works on DTensor
        parameters (nn.init dispatches on them). `buffer_device` places the RoPE tables, e.g. on
        the GPU when the parameters were materialised on the CPU.
        """
        buffer_device = buffer_device if buffer_device is not None else self.rope_cos.device
        with torch.device(buffer_device):
            self.rope_cos, self.rope_sin = self._rope_tables()
        # Tied: one matrix serves both ends; it takes the output init because the logit scale
        # matters at step 0, while the embedding's scale is normalised away by the first RMSNorm.
        if self.tok_embeddings is not None and not self.tie_embeddings:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        self._init_blocks()
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def _init_blocks(self) -> None:
        for layer in self.layers.values():
            layer.init_weights()
