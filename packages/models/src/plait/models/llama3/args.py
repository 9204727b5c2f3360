"""Llama 3 hyperparameters as one plain dataclass (what a flavor is, what a config overrides)."""

from dataclasses import dataclass

from plait.models.common import check_gqa_heads
from plait.models.documents import check_masks


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling ("llama3" rope_type in HF).

    Wavelengths shorter than original_max_seq_len / high_freq_factor keep their frequency,
    wavelengths longer than original_max_seq_len / low_freq_factor are divided by `factor`, and the
    band between is interpolated smoothly. This stretches long-range frequencies for long context
    while leaving the local ones the model learned at 8k untouched.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass
class ModelArgs:
    """Everything that fixes the shape and numerics of a Llama 3 model."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    # None means multi-head attention (as many kv heads as query heads).
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    # The SwiGLU hidden size is 2/3 * 4 * dim, scaled by ffn_dim_multiplier, rounded up to this.
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    # RoPE tables are precomputed for this many positions; positions index into them.
    max_seq_len: int = 2048
    # Share one [vocab, dim] matrix between the token embedding and the output projection.
    tie_embeddings: bool = False
    # Scale the init std of each block's output projections by its depth (torchtitan) rather than
    # by the total number of layers.
    depth_init: bool = True
    # "causal" or "document" / "sequence" or "document": plait.models.documents says what each means.
    attention_mask: str = "causal"
    rope_positions: str = "sequence"

    def __post_init__(self):
        check_masks(self.attention_mask, self.rope_positions)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if isinstance(self.rope_scaling, dict):  # e.g. straight from a TOML config
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        check_gqa_heads(self.n_heads, self.n_kv_heads, self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # SwiGLU has three matrices instead of two, so 2/3 of the usual 4*dim keeps the parameter count.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
