"""DeepSeek-V2/V3 hyperparameters as one plain dataclass (what a flavor is, what a config overrides)."""

import math
from dataclasses import dataclass
from typing import Literal

from plait.models.documents import check_masks


@dataclass
class ModelArgs:
    """Everything that fixes the shape and numerics of a DeepSeek-V3-style MoE transformer.

    Defaults are the `debugmodel` flavor (torchtitan's debug dimensions).
    """

    vocab_size: int = 2048
    dim: int = 256
    # Hidden size of the dense SwiGLU in the first `n_dense_layers` blocks.
    inter_dim: int = 1024
    # Hidden size of one routed expert; shared experts use moe_inter_dim * n_shared_experts.
    moe_inter_dim: int = 256
    n_layers: int = 6
    n_dense_layers: int = 1
    n_heads: int = 16
    norm_eps: float = 1e-5

    # ---- MoE ----
    n_routed_experts: int = 8
    n_shared_experts: int = 2
    # Experts each token is routed to (top-k).
    n_activated_experts: int = 3
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # Renormalise each token's top-k weights to sum to 1 (HF `norm_topk_prob`).
    route_norm: bool = False
    # Multiplies the routing weights (HF `routed_scaling_factor`).
    route_scale: float = 1.0
    # Group-limited routing: experts in n_expert_groups groups, tokens pick from the best
    # n_limited_groups of them. 1/1 disables it.
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    # Sequence-wise auxiliary balance loss weight (0 = off; DeepSeek-V3 used 1e-4).
    aux_loss_coeff: float = 0.0
    # Aux-loss-free balancing step size, read by the trainer for update_moe_load_balance.
    load_balance_coeff: float = 1e-3
    # grouped_mm experts (True) or the per-expert loop kept as a reference (False).
    use_grouped_mm: bool = True

    # ---- Multi-head latent attention ----
    # 0: queries come from one dim -> n_heads * qk_head_dim projection (wq); else a low-rank
    # wq_a -> q_norm -> wq_b path.
    q_lora_rank: int = 0
    # Keys and values are rebuilt from this compressed latent (the only thing a KV cache stores).
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    # Decoupled RoPE: one extra rotary key of this size shared by all heads.
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    # ---- RoPE with YaRN ----
    # RoPE tables are precomputed for this many positions; positions index into them.
    max_seq_len: int = 4096 * 4
    rope_theta: float = 10000.0
    # YaRN applies only when max_seq_len > original_seq_len (DeepSeek's reference rule).
    original_seq_len: int = 4096
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Softmax-scale correction: scale *= (0.1 * mscale * ln(rope_factor) + 1) ** 2 under YaRN.
    mscale: float = 1.0

    # ---- Multi-token prediction (DeepSeek-V3 section 2.2) ----
    # Depths after the last block, each predicting one token further ahead (mtp.py); 0: none.
    mtp_layers: int = 0
    # The trainer's loss: main + mtp_loss_scale x the mean of the depths' losses (DeepSeek-V3: 0.1).
    mtp_loss_scale: float = 0.1

    # Scale each block's output-projection init std by its depth (torchtitan) instead of n_layers.
    depth_init: bool = True
    # "causal" or "document" / "sequence" or "document": plait.models.documents says what each means.
    attention_mask: str = "causal"
    rope_positions: str = "sequence"

    def __post_init__(self):
        check_masks(self.attention_mask, self.rope_positions)
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers {self.n_dense_layers} not in [0, n_layers={self.n_layers}]")
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError("n_activated_experts exceeds n_routed_experts")
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError("n_routed_experts must be divisible by n_expert_groups")
        if self.mtp_layers < 0:
            raise ValueError(f"mtp_layers {self.mtp_layers} is negative: 0 turns multi-token prediction off")
        if not math.isfinite(self.mtp_loss_scale) or self.mtp_loss_scale < 0:
            raise ValueError(f"mtp_loss_scale {self.mtp_loss_scale} must be finite and >= 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def uses_yarn(self) -> bool:
        return self.rope_factor != 1.0 and self.max_seq_len > self.original_seq_len
