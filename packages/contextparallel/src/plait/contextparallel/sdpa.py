"""Context parallel for models plait did not write: a drop-in for F.scaled_dot_product_attention.

A model that calls `F.scaled_dot_product_attention` (or transformers' attention interface) has no
`sdpa` submodule for `apply_context_parallel` to replace, so the replacement is a function instead:

    cp_sdpa = ContextParallelSDPA(meshes.cp, ContextParallelConfig("ring"))
    cp_sdpa(q, k, v, is_causal=True, enable_gqa=True)          # F.scaled_dot_product_attention's signature
    with cp_sdpa.patch(): loss = model(...); loss.backward()   # a plain module that calls F.sdpa
    AttentionInterface.register("plait_cp", cp_sdpa.transformers_attention)   # transformers

It computes what the model's call would compute on the full sequence -- causal attention, GQA,
any scale -- while q/k/v hold this rank's tokens in `cp_sdpa.layout`'s order (`shard_batch`).
What cannot be sharded that way (an arbitrary attn_mask, non-causal attention, dropout, a KV
cache) is refused in one line before any collective. This module does not import transformers.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .attention import ContextParallelAttention
from .config import METHODS, ContextParallelConfig
from .layout import SequenceLayout


class ContextParallelSDPA:
    """`F.scaled_dot_product_attention` over a sequence sharded across `cp_mesh` in `self.layout`.

    q [B, H, L, D], k/v [B, G, L, D] (L = this rank's S / cp tokens) -> [B, H, L, Dv]. Causal only;
    G < H needs enable_gqa=True, as for SDPA, and goes to the kernels without repeating K/V.
    """

    def __init__(self, cp_mesh: DeviceMesh, config: ContextParallelConfig | None = None):
        config = config or ContextParallelConfig()
        if config.method not in METHODS:
            raise ValueError(f"ContextParallelConfig.method = {config.method!r}: use one of {', '.join(METHODS)}.")
        self.mesh, self.config = cp_mesh, config
        self.layout = SequenceLayout(cp_mesh.size(), config.load_balance, config.load_balance_rounds)
        self._attention = ContextParallelAttention(cp_mesh, config.method, self.layout)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        self._check(
            query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, "attn_mask", "dropout_p", "is_causal"
        )
        return self._run(query, key, value, scale)

    def transformers_attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention-interface signature: returns (out [B, L, H, Dv], None).

        Register it (`AttentionInterface.register("plait_cp", cp_sdpa.transformers_attention)`) and
        select it (`model.set_attn_implementation("plait_cp")`). transformers builds no mask for an
        implementation without a mask function, so attention_mask arrives None and causality comes
        from the module's `is_causal` (True for decoder layers).
        """
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        self._check(
            query, key, value, attention_mask, dropout, is_causal, True, "attention_mask", "dropout", "module.is_causal"
        )
        return self._run(query, key, value, scaling).transpose(1, 2), None

    @contextlib.contextmanager
    def patch(self) -> Iterator["ContextParallelSDPA"]:
        """Route `torch.nn.functional.scaled_dot_product_attention` through this function inside the
        block, for modules that call it as `F.scaled_dot_product_attention(...)` at run time. Keep
        the backward inside the block too when the model recomputes activations (checkpointing)."""
        original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self
        try:
            yield self
        finally:
            F.scaled_dot_product_attention = original

    def _run(self, query, key, value, scale) -> torch.Tensor:
        self._attention.scale = scale
        return self._attention(query, key, value)

    def _check(self, query, key, value, mask, dropout, is_causal, gqa, mask_name, dropout_name, causal_name) -> None:
        """Everything this function cannot compute, refused before the first collective."""
        where = "context-parallel attention (plait.contextparallel.ContextParallelSDPA)"
        if mask is not None:
            raise ValueError(
                f"{where}: {mask_name} (a {tuple(mask.shape)} mask) is not supported; it computes causal attention "
                f"only: pass {mask_name}=None with causal attention (transformers: no attention_mask, no padding)."
            )
        if not is_causal:
            raise ValueError(
                f"{where}: {causal_name}=False (bidirectional attention) is not supported; only causal attention."
            )
        if dropout:
            raise ValueError(f"{where}: {dropout_name}={dropout} is not supported; set attention dropout to 0.")
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                f"{where}: needs 4-D query/key/value [B, heads, seq, head_dim], got {query.dim()}/{key.dim()}/{value.dim()}-D."
            )
        H, G = query.shape[1], key.shape[1]
        if H != G and not (gqa and H % G == 0):
            raise ValueError(
                f"{where}: {H} query heads over {G} kv heads need enable_gqa=True and heads divisible by kv heads."
            )
        if self.config.method == "ulysses" and H % self.layout.cp:
            raise ValueError(
                f"{where}: method 'ulysses' splits the {H} query heads over cp = {self.layout.cp}, which does not divide them: use 'ring' or 'allgather'."
            )
        L, chunks = query.shape[2], self.layout.chunks_per_rank
        if key.shape[2] != L:
            raise ValueError(
                f"{where}: query length {L} != key length {key.shape[2]} (a KV cache / decoding) is not supported: "
                f"feed whole sequences (transformers: use_cache=False)."
            )
        if L % chunks:
            raise ValueError(
                f"{where}: this rank's {L} tokens are not divisible into its {chunks} chunks: shard a sequence of a "
                f"multiple of {self.layout.n_chunks} tokens with shard_batch / shard_sequence."
            )
