"""Multi-token prediction (DeepSeek-V3 section 2.2): depth k predicts the token k + 1 places ahead.

Depth k takes the previous depth's hidden state h^{k-1} (depth 0: the last block's output, before
the final norm) and the embeddings of the input tokens shifted by k, normalises each, joins them
and projects back to the model width, then runs one transformer block:

    h^k = Block_k( W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] )

Its logits come from its own norm and the model's shared output head (and embedding): the model
(model.py) owns those, so this module holds only what a depth adds. Names follow the released
DeepSeek-V3 weights: `enorm`, `hnorm`, `eh_proj`, and `norm` for `shared_head.norm`.
"""

import torch
from torch import nn

from plait.models.common import INIT_STD
from plait.models.cpu_bf16 import Linear


class MultiTokenPrediction(nn.Module):
    """One MTP depth around `block` (a TransformerBlock the model builds with its own layer id)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        # [embedding; hidden] -> dim, in the released weights' order.
        self.eh_proj = Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)  # before the shared output head

    def forward(
        self,
        h_BSD: torch.Tensor,
        embedded_BSD: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h^{k-1} [B, S, D] and the depth's shifted-token embeddings [B, S, D] -> h^k [B, S, D]."""
        joined_BS2D = torch.cat([self.enorm(embedded_BSD), self.hnorm(h_BSD)], dim=-1)
        return self.block(self.eh_proj(joined_BS2D), rope_cos, rope_sin, document_positions_BS, document_offsets)

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            nn.init.ones_(norm.weight)
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=INIT_STD)
        self.block.init_weights()
