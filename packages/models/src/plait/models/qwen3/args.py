"""Qwen3 hyperparameters, dense and MoE, as one plain dataclass (what a flavor is, what a config overrides)."""

from dataclasses import dataclass

from plait.models.common import check_gqa_heads
from plait.models.documents import check_masks


@dataclass
class ModelArgs:
    """Everything that fixes the shape and numerics of a Qwen3 model.

    `n_routed_experts = 0` is a dense Qwen3 (every block a SwiGLU of `inter_dim`); above 0 every block
    is a Qwen3-MoE block (the released MoE models have no dense block). Defaults are Qwen3-0.6B's
    sizes without its tied embedding.
    """

    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    # Qwen3 sets the head size on its own (128 in every release), not as dim / n_heads.
    head_dim: int = 128
    vocab_size: int = 151936
    # Hidden size of a dense block's SwiGLU (HF `intermediate_size`).
    inter_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # RoPE tables are precomputed for this many positions; positions index into them.
    max_seq_len: int = 40960
    # Share one [vocab, dim] matrix between the token embedding and the output projection
    # (HF `tie_word_embeddings`; the 0.6B, 1.7B and 4B releases tie).
    tie_embeddings: bool = False

    # ---- MoE (used when n_routed_experts > 0) ----
    # Routed experts per MoE block (HF `num_experts`); 0: a dense model.
    n_routed_experts: int = 0
    # Experts each token is routed to (top-k, HF `num_experts_per_tok`).
    n_activated_experts: int = 8
    # Hidden size of one routed expert (HF `moe_intermediate_size`).
    moe_inter_dim: int = 768
    # Renormalise each token's top-k softmax weights to sum to 1 (HF `norm_topk_prob`).
    route_norm: bool = True
    # Sequence-wise auxiliary balance loss weight (0 = off); Qwen3-MoE's `router_aux_loss_coef`.
    aux_loss_coeff: float = 0.001
    # Auxiliary-loss-free balancing step size (0 = off). Hugging Face's Qwen3-MoE routes without a
    # selection bias, so a model trained with it does not export (hf/qwen3.py refuses it).
    load_balance_coeff: float = 0.0
    # grouped_mm experts (True) or the per-expert loop kept as a reference (False).
    use_grouped_mm: bool = True

    # Scale each block's output-projection init std by its depth (torchtitan) instead of n_layers.
    depth_init: bool = True
    # "causal" or "document" / "sequence" or "document": plait.models.documents says what each means.
    attention_mask: str = "causal"
    rope_positions: str = "sequence"

    def __post_init__(self):
        check_masks(self.attention_mask, self.rope_positions)
        check_gqa_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        if self.n_routed_experts < 0:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is negative: 0 makes a dense model")
        if self.is_moe and not 1 <= self.n_activated_experts <= self.n_routed_experts:
            raise ValueError(f"n_activated_experts {self.n_activated_experts} not in [1, n_routed_experts="
                             f"{self.n_routed_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0
