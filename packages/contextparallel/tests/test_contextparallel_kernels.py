"""The lse-returning kernels against fp64 attention: CPU flash (fp32, bf16), the math fallback,
GQA without copies, MLA's Dqk != Dv, inputs laid out as the models pass them (transposed views)."""

import pytest
import torch
from cp_reference import random_qkv, reference_with_grads

from plait.contextparallel.kernels import (
    MergedAttention,
    attention_backward,
    attention_forward,
    math_backward,
    math_forward,
)

SHAPES = {"gqa": (4, 2, 16, 16), "mha": (2, 2, 16, 16), "mla": (2, 2, 24, 16)}


def _run(fwd, bwd, q, k, v, dout, causal, scale):
    out, lse = fwd(q, k, v, causal, scale)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, causal, scale)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_attention(shape, kernel, dtype):
    H, G, dqk, dv = SHAPES[shape]
    q, k, v, dout = random_qkv(2, H, G, 20, dqk, dv, dtype=dtype)
    # The models pass transposed views of [B, S, H, D] projections: not contiguous.
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, dout, scale=0.3)
    fwd, bwd = (attention_forward, attention_backward) if kernel == "cpu_flash" else (math_forward, math_backward)
    out, lse, dq, dk, dv = _run(fwd, bwd, q, k, v, dout, True, 0.3)
    assert lse.dtype == torch.float32 and lse.shape == (2, H, 20)
    assert out.dtype == dtype and dk.shape == k.shape and dv.shape == v.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for got, want in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(got.double(), want, **tol)


def test_non_causal_rectangular_block_and_merge():
    # A query block against keys it sees fully, split in two key blocks and merged through the lse.
    q, k, v, dout = random_qkv(1, 4, 2, 12, 16, 16, dtype=torch.float64)
    full_out, full_lse = math_forward(q, k, v, False, 0.25)
    acc = MergedAttention(q, 16)
    for keys in (slice(0, 5), slice(5, 12)):
        out, lse = attention_forward(q, k[:, :, keys], v[:, :, keys], False, 0.25)
        acc.add(slice(0, 12), out, lse)
    torch.testing.assert_close(acc.out, full_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(acc.lse, full_lse, atol=1e-12, rtol=1e-12)
