"""Pieces every plait model shares."""

import torch
import torch.nn.functional as F
from torch import nn

from plait.models import cpu_bf16
from plait.models.cpu_bf16 import Linear
from plait.models.documents import check_document_positions, row_segments


class ScaledDotProductAttention(nn.Module):
    """Causal attention: q [B, H, S, Dqk], k [B, G, S, Dqk], v [B, G, S, Dv] -> [B, H, S, Dv].

    Grouped-query attention goes to the kernels as it is (G kv heads, H a multiple of G): copying
    K/V up to H heads would multiply their activation memory by H / G (4x for Llama 3 8B, 16x for
    405B). A model calls attention only through this module, so context parallel can swap in
    all-gather, ring or all-to-all attention without touching the model; `scale` (None: 1/sqrt(Dqk))
    is part of that contract.

    `document_positions_BS` (int32 [B, S], plait.models.documents) switches to the document mask:
    each segment of a packed row attends causally within itself only, one kernel call per segment.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q_BHSD: torch.Tensor,
        k_BGSD: torch.Tensor,
        v_BGSD: torch.Tensor,
        document_positions_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_positions_BS is None:
            return causal_attention(q_BHSD, k_BGSD, v_BGSD, self.scale)
        return document_attention(q_BHSD, k_BGSD, v_BGSD, document_positions_BS, self.scale)


# The per-segment loop reads host data and has data-dependent slices: a compiled block calls it
# eagerly (like context parallel's attention), and the kernels inside are the same as causal's.
@torch.compiler.disable
def document_attention(q_BHSD, k_BGSD, v_BGSD, document_positions_BS, scale: float | None) -> torch.Tensor:
    """Block-diagonal causal attention over the segments of each row.

    The rows and segments are cut with `split`, not slices: autograd then joins the pieces'
    gradients with one `cat`, where a slice's backward writes its piece into a zero tensor of the
    whole input's size (one such tensor, and one add, per segment, per q, k and v)."""
    B, _, S, _ = q_BHSD.shape
    check_document_positions(document_positions_BS, B, S)
    segments = row_segments(document_positions_BS)
    if segments.count(segments[0]) == B:  # every row cut the same way: batch the calls
        row_groups = [(q_BHSD, k_BGSD, v_BGSD, segments[0])]
    else:
        row_groups = zip(q_BHSD.split(1), k_BGSD.split(1), v_BGSD.split(1), segments, strict=True)
    rows_out = []
    for q, k, v, bounds in row_groups:
        if len(bounds) == 2:  # one segment: plain causal attention over the row
            rows_out.append(causal_attention(q, k, v, scale))
            continue
        lengths = [e - s for s, e in zip(bounds, bounds[1:])]
        pieces = [
            causal_attention(q_piece, k_piece, v_piece, scale)
            for q_piece, k_piece, v_piece in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]
        rows_out.append(torch.cat(pieces, dim=2))
    return rows_out[0] if len(rows_out) == 1 else torch.cat(rows_out, dim=0)


def causal_attention(q_BHSD, k_BGSD, v_BGSD, scale: float | None) -> torch.Tensor:
    gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
    dqk, dv = q_BHSD.shape[-1], v_BGSD.shape[-1]
    if q_BHSD.device.type == "cpu" and _low_precision(q_BHSD) and cpu_bf16.cpu_attends_in_fp32(dqk):
        # The rule and its measurements: cpu_bf16.py.
        autocast = torch.is_autocast_enabled("cpu")
        out_dtype = torch.get_autocast_dtype("cpu") if autocast else q_BHSD.dtype
        # MLA's narrower values padded for the flash kernel (the math path's S x S scores would not
        # fit at long sequences); the padding's output columns are zeros, sliced off.
        v_float = F.pad(v_BGSD.float(), (0, dqk - dv)) if dv < dqk else v_BGSD.float()
        with torch.autocast("cpu", enabled=False):
            out_BHSD = F.scaled_dot_product_attention(
                q_BHSD.float(), k_BGSD.float(), v_float, is_causal=True, scale=scale, enable_gqa=gqa
            )
        return out_BHSD[..., :dv].to(out_dtype)
    if q_BHSD.device.type == "cpu" and dv < dqk and _low_precision(q_BHSD):
        # MLA (v narrower than q/k): torch's CPU flash kernel needs equal head dims, otherwise SDPA
        # takes its math path and materialises the S x S scores. In bf16 the flash kernel on
        # zero-padded values is faster (1.4x forward + backward at DeepSeek-V3 debug's 192/128);
        # the padding's output columns are zeros and are sliced off.
        out_BHSD = F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, F.pad(v_BGSD, (0, dqk - dv)), is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out_BHSD[..., :dv]
    return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=scale, enable_gqa=gqa)


def _low_precision(x: torch.Tensor) -> bool:
    return x.dtype != torch.float32 or torch.is_autocast_enabled("cpu")


INIT_STD = 0.02


class FeedForward(nn.Module):
    """SwiGLU, `w2(silu(w1 x) * w3 x)`: Llama's FFN, DeepSeek's dense FFN and its shared experts.

    Bias-free Linears (cpu_bf16.Linear: nn.Linear) named as the tensor-parallel plans expect.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, dim, bias=False)
        self.w3 = Linear(dim, hidden_dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))

    def init_weights(self, out_proj_std: float) -> None:
        # w1 feeds the gate nonlinearity; w2 and w3 shape what is written into the residual
        # stream, so they get the depth-scaled std (torchtitan's convention).
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=INIT_STD)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_proj_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=out_proj_std)
