"""Pieces every plait model shares."""

import torch
import torch.nn.functional as F
from torch import nn

from plait.models import cpu_bf16
from plait.models.cpu_bf16 import Linear
from plait.models.document_attention import document_attention
from plait.models.documents import check_document_positions, offsets_of


class ScaledDotProductAttention(nn.Module):
    """Causal attention: q [B, H, S, Dqk], k [B, G, S, Dqk], v [B, G, S, Dv] -> [B, H, S, Dv].

    Grouped-query attention goes to the kernels as it is (G kv heads, H a multiple of G): copying
    K/V up to H heads would multiply their activation memory by H / G (4x for Llama 3 8B, 16x for
    405B). A model calls attention only through this module, so context parallel can swap in
    all-gather, ring or all-to-all attention without touching the model; `scale` (None: 1/sqrt(Dqk))
    is part of that contract.

    `document_positions_BS` (int32 [B, S], plait.models.documents) switches to the document mask:
    each segment of a packed row attends causally within itself only, in one op for the whole
    batch (plait.models.document_attention) given the documents' offsets in the folded tokens,
    `document_offsets` (the model's forward builds them once for every layer: offsets_of).
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
        document_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_positions_BS is None:
            return causal_attention(q_BHSD, k_BGSD, v_BGSD, self.scale)
        B, H, S, _ = q_BHSD.shape
        check_document_positions(document_positions_BS, B, S)
        if document_offsets is None:  # eager callers; the model passes them (no host read in a graph)
            document_offsets = offsets_of(document_positions_BS)
        # [B, H, S, D] -> the folded tokens [B x S, H, D]: the models' q / k / v are transposed
        # views of [B, S, H, D], so this is a view there.
        q_THA, k_TGA, v_TGA = (t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[-1]) for t in (q_BHSD, k_BGSD, v_BGSD))
        out_THA = document_attention(q_THA, k_TGA, v_TGA, document_offsets, S, self.scale)
        return out_THA.view(B, S, H, -1).transpose(1, 2)


def causal_attention(q_BHSD, k_BGSD, v_BGSD, scale: float | None) -> torch.Tensor:
    gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
    dqk, dv = q_BHSD.shape[-1], v_BGSD.shape[-1]
    if q_BHSD.device.type == "cpu" and dv < dqk and not gqa and cpu_bf16.GPU_ROUTE and _traced(q_BHSD):
        # A GPU's MLA, traced (cpu_bf16.gpu_route): no flash kernel takes unequal head dims, so SDPA
        # runs the memory-efficient one: out [B, H, S, Dv] and an fp32 log-sum-exp, no padded values
        # (the CPU routes below pad them, or take the math path with its S x S scores).
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            q_BHSD, k_BGSD, v_BGSD = q_BHSD.to(dtype), k_BGSD.to(dtype), v_BGSD.to(dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q_BHSD, k_BGSD, v_BGSD, None, True, 0.0, True, scale=scale
        )[0]
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


def _traced(x: torch.Tensor) -> bool:
    """A fake or meta tensor: shapes only, no CPU kernel runs (a model imports no tracer to ask)."""
    return type(x).__name__ == "FakeTensor" or x.is_meta


def _low_precision(x: torch.Tensor) -> bool:
    """fp16 / bf16, or autocast's lower precision: fp64 stays fp64 (it was taken for low precision
    and attended in fp32)."""
    return x.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled("cpu")


# The std of the projections that read the residual stream (torchtitan's scheme). Like torchtitan
# we keep trunc_normal_'s default cutoffs of +-2 (absolute), which at this std truncate nothing.
INIT_STD = 0.02


def check_gqa_heads(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Grouped-query attention's sizes (Llama 3, Qwen3 args): whole query heads per kv head, and
    head_dim even, as RoPE rotates pairs."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")


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
