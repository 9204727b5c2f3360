"""DeepSeek-V3 (DeepSeek-AI, 2024): multi-head latent attention, a few dense SwiGLU blocks, then
token-choice MoE blocks with shared experts and auxiliary-loss-free load balancing.

Plain single-device PyTorch. Parallelism is applied from outside using the data that
`Transformer.parallel_info()` returns (docs/contracts.md); shapes are inferred from tensors so
tensor parallel's local head counts and expert parallel's local experts work unchanged.
Multi-token prediction (`mtp_layers` depths after the last block) is mtp.py.
"""

import torch
from torch import nn

from plait.models import metadata
from plait.models.common import INIT_STD, ScaledDotProductAttention
from plait.models.cpu_bf16 import Linear
from plait.models.decoder import Decoder, PreNormBlock, moe_block
from plait.models.deepseek_v3.args import ModelArgs
from plait.models.deepseek_v3.mtp import MultiTokenPrediction
from plait.models.deepseek_v3.rope import rope_tables, softmax_scale
from plait.models.moe import FeedForward, MoE
from plait.models.rope import apply_rope

# INIT_STD (common.py): init std of projections that read the residual stream (torchtitan's scheme).


class Attention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 section 2.1).

    Keys and values are rebuilt per head from a `kv_lora_rank` latent; a separate
    `qk_rope_head_dim` slice carries position (RoPE cannot pass through the low-rank
    up-projection, so it is decoupled): per head, q = [q_nope, q_rope], k = [k_nope, k_rope]
    with one k_rope shared by all heads.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        if self.q_lora_rank == 0:
            self.wq = Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = Linear(self.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = Linear(self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        # The one place attention is computed; context parallel replaces this module. SDPA takes
        # a v head dim different from q/k's, so v is passed unpadded.
        self.sdpa = ScaledDotProductAttention(scale=softmax_scale(args))

    def forward(
        self, x_BSD: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape

        # Queries: [B, S, H, nope + rope]; H inferred so TP's local heads work.
        q_BSE = self.wq(x_BSD) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_BSHQ = q_BSE.view(B, S, -1, self.qk_head_dim)
        q_nope_BSHN, q_rope_BSHR = q_BSHQ.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rope_BSHR = apply_rope(q_rope_BSHR, rope_cos, rope_sin)

        # Keys/values: compress to the latent (+ the shared rotary key), then expand per head.
        kv_BSC = self.wkv_a(x_BSD)
        latent_BSL, k_rope_BSR = kv_BSC.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope_BS1R = apply_rope(k_rope_BSR.unsqueeze(2), rope_cos, rope_sin)
        kv_BSHF = self.wkv_b(self.kv_norm(latent_BSL)).view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope_BSHN, v_BSHV = kv_BSHF.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        H = k_nope_BSHN.shape[2]

        q_BSHQ = torch.cat([q_nope_BSHN, q_rope_BSHR], dim=-1)
        k_BSHQ = torch.cat([k_nope_BSHN, k_rope_BS1R.expand(-1, -1, H, -1)], dim=-1)

        # Causal calls keep the 3-argument sdpa contract; the document mask adds its positions
        # and their offsets in the folded tokens.
        documents = () if document_positions_BS is None else (document_positions_BS, document_offsets)
        out_BHSV = self.sdpa(
            q_BSHQ.transpose(1, 2), k_BSHQ.transpose(1, 2), v_BSHV.transpose(1, 2), *documents
        )
        return self.wo(out_BHSV.transpose(1, 2).reshape(B, S, -1))

    def init_weights(self, out_proj_std: float) -> None:
        projections = [self.wkv_a, self.wkv_b]
        projections += [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for linear in projections:
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=INIT_STD)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_proj_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank > 0:
            self.q_norm.reset_parameters()


def build_moe(args: ModelArgs) -> MoE:
    """DeepSeek's MoE block: shared experts beside the routed ones, softmax (V2) or sigmoid (V3)
    scores, optionally group-limited, renormalised and scaled."""
    return moe_block(args, args.n_shared_experts, score_func=args.score_func, route_scale=args.route_scale,
                     n_groups=args.n_expert_groups, topk_groups=args.n_limited_groups)


class TransformerBlock(PreNormBlock):
    """Pre-norm residual block: attention, then a dense FFN (`feed_forward`, the first
    n_dense_layers blocks) or an MoE (`moe`)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        attention = Attention(args)  # first: a seeded build draws its weights in this order
        ffn = FeedForward(args.dim, args.inter_dim) if layer_id < args.n_dense_layers else build_moe(args)
        super().__init__(layer_id, args, attention, ffn)


class Transformer(Decoder):
    """Token embedding -> n_layers blocks -> RMSNorm -> output projection to vocabulary logits
    (plait.models.decoder), with YaRN-scaled RoPE and `mtp_layers` multi-token-prediction depths."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, lambda i: TransformerBlock(i, args))
        # Depth k's block is layer n_layers + k - 1 (the released weights' numbering).
        self.mtp = nn.ModuleDict({
            str(k): MultiTokenPrediction(args.dim, args.norm_eps, TransformerBlock(args.n_layers + k, args))
            for k in range(args.mtp_layers)
        }) if args.mtp_layers else None  # fmt: skip

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.args)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_positions: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ):
        """tokens [B, S] int64, positions [S] or [B, S] int64, document_positions [B, S] int32 of the
        full rows (plait.models.documents; needed by attention_mask / rope_positions = "document")
        -> logits [B, S, V]. positions default: arange(S), or the document positions.

        mtp_tokens [B, K, S] int64 (K <= mtp_layers): depth k's input tokens, the row shifted by k
        (the trainer shifts whole rows before context parallel splits them). Then the result is
        (logits [B, S, V], logits of depth 1, ..., K); without them, the main logits alone.
        Pipeline stages: the first embeds the shifted rows too and every stage before the last
        hands them on beside the hidden state, [B, S, (1 + K) x D] (one embedding, on the first
        stage; the last runs the depths)."""
        depths = 0 if mtp_tokens is None or self.mtp is None else mtp_tokens.shape[1]
        if self.tok_embeddings is None:  # a later pipeline stage: hidden states, and the depths' rows
            h_BSD, *embedded = tokens.chunk(1 + depths, dim=-1) if depths else (tokens,)
        else:  # one embedding call for the row and every depth's shifted row (one FSDP gather)
            rows = torch.cat([tokens[:, None], mtp_tokens[:, :depths]], 1).transpose(0, 1).flatten(0, 1) \
                if depths else tokens
            h_BSD, *embedded = self.tok_embeddings(rows).chunk(1 + depths)
        block_inputs = self._block_inputs(tokens, positions, document_positions)
        for layer in self.layers.values():
            h_BSD = layer(h_BSD, *block_inputs)
        if self.norm is None:
            return torch.cat([h_BSD, *embedded], dim=-1) if depths else h_BSD
        heads = [self.norm(h_BSD)]
        for mtp, embedded_BSD in zip(list(self.mtp.values())[:depths] if depths else [], embedded):
            h_BSD = mtp(h_BSD, embedded_BSD, *block_inputs)
            heads.append(mtp.norm(h_BSD))
        # One call of the shared output head for every depth (one FSDP gather, one TP region).
        logits = self.output(torch.cat(heads) if depths else heads[0])
        if not depths:
            return logits
        return tuple(logits.chunk(1 + depths))  # (main, depth 1, ..., depth K)

    def _init_blocks(self) -> None:
        super()._init_blocks()
        for mtp in (self.mtp or {}).values():
            mtp.init_weights()

    def parallel_info(self) -> dict:
        """Blocks, tensor-parallel plan, experts and CP metadata as plain data (docs/contracts.md)."""
        blocks = [f"layers.{name}" for name in self.layers]
        # Each MTP depth is one more block (an FSDP / AC / compile unit) whose transformer block
        # sits under `.block`.
        mtp_depths = [f"mtp.{name}" for name in self.mtp or {}]
        transformer_blocks = {**dict(zip(blocks, self.layers.values())),
                              **{f"{d}.block": m.block for d, m in zip(mtp_depths, (self.mtp or {}).values())}}
        moe_blocks = {b: layer.moe for b, layer in transformer_blocks.items() if layer.is_moe}
        args = self.args
        return metadata.parallel_info(
            blocks + mtp_depths,
            self._tp_plan(),
            experts=[f"{b}.moe.experts" for b in moe_blocks],
            # MLA rebuilds keys and values per head: as many kv heads as query heads.
            heads=(args.n_heads, args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim),
            # Heads, dense and shared-expert FFN hidden, vocab.
            tp_divisible={"n_heads": args.n_heads, "ffn_hidden": args.inter_dim,
                          "shared_expert_hidden": args.moe_inter_dim * args.n_shared_experts,
                          "vocab_size": args.vocab_size},
            expert_overlap={f"{b}.moe.experts": f"{b}.moe.shared_experts"
                            for b, moe in moe_blocks.items() if moe.shared_experts is not None},
            attention_blocks=list(transformer_blocks),
        )

    def _tp_plan(self) -> dict:
        if self.args.q_lora_rank == 0:
            q_plan = {"layers.*.attention.wq": "colwise"}
        else:
            q_plan = {
                "layers.*.attention.wq_a": "replicate",
                "layers.*.attention.q_norm": "replicate",
                "layers.*.attention.wq_b": "colwise",
            }
        # The latent path is shared by all heads: replicated. wkv_b expands it per head (colwise
        # over heads); wo sums heads back (rowwise).
        latent_plan = {
            "layers.*.attention.wkv_a": "replicate",
            "layers.*.attention.kv_norm": "replicate",
            "layers.*.attention.wkv_b": "colwise",
        }
        block_plan = {**metadata.attention_plan({**q_plan, **latent_plan}), **metadata.DENSE_FFN_PLAN,
                      **metadata.moe_plan(shared_experts=True)}
        # An MTP depth's norms and projection act on each token alone: on sequence shards under SP
        # (replicated weights, gradients reduced), like the block norms; its block as the others.
        mtp_plan = {"mtp.*.enorm": "sequence_parallel", "mtp.*.hnorm": "sequence_parallel",
                    "mtp.*.eh_proj": "sequence_parallel", "mtp.*.norm": "sequence_parallel",
                    **{key.replace("layers.*.", "mtp.*.block.", 1): style for key, style in block_plan.items()
                       if ".feed_forward" not in key}}  # an MTP block is past n_dense_layers: MoE
        return {**metadata.EDGE_PLAN, **block_plan, **(mtp_plan if self.mtp is not None else {})}

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, counted from args. Active keeps only the top-k
        routed experts of each MoE layer (plus shared experts, attention, norms, embeddings)."""
        a = self.args
        if a.q_lora_rank == 0:
            q = a.dim * a.n_heads * a.qk_head_dim
        else:
            q = a.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.n_heads * a.qk_head_dim
        kv = (
            a.dim * (a.kv_lora_rank + a.qk_rope_head_dim)
            + a.kv_lora_rank
            + a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
        )
        attention = q + kv + a.n_heads * a.v_head_dim * a.dim + 2 * a.dim  # + block norms
        dense_ffn = 3 * a.dim * a.inter_dim
        expert = 3 * a.dim * a.moe_inter_dim
        moe_fixed = a.dim * a.n_routed_experts + a.n_shared_experts * expert  # gate + shared
        # MTP depths: an MoE block each (past n_dense_layers), enorm, hnorm, eh_proj and a norm.
        n_moe = a.n_layers - a.n_dense_layers + a.mtp_layers
        fixed = (a.n_layers + a.mtp_layers) * attention + a.n_dense_layers * dense_ffn + n_moe * moe_fixed
        fixed += a.mtp_layers * (2 * a.dim * a.dim + 3 * a.dim)
        fixed += 2 * a.vocab_size * a.dim + a.dim  # embedding, output, final norm
        total = fixed + n_moe * a.n_routed_experts * expert
        active = fixed + n_moe * a.n_activated_experts * expert
        return total, active

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active non-embedding params + attention.

        Active counts top-k routed experts, not all of them. Attention is the torchtitan
        convention (causal not halved) with MLA's two head sizes: 6 * L * H * (qk + v) * seq_len,
        which is 12 * L * H * head_dim * seq_len when they are equal.
        """
        a = self.args
        _, active = self.param_counts()
        # Each MTP depth runs the shared output head once more.
        non_embedding = active - a.vocab_size * a.dim + a.mtp_layers * a.vocab_size * a.dim
        attention = 6 * (a.n_layers + a.mtp_layers) * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
        return 6 * non_embedding + attention
