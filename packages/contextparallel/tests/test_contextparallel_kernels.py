"""The lse-returning kernels against fp64 attention: CPU flash (fp32, bf16), the math fallback,
GQA without copies, MLA's Dqk != Dv, inputs laid out as the models pass them (transposed views)."""

import pytest
import torch
from cp_reference import random_qkv, reference_with_grads

from plait.contextparallel import kernels
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


@pytest.mark.parametrize("bf16_units", [True, False])
def test_cpu_bf16_blocks_run_the_kernel_in_fp32_where_that_is_faster(bf16_units, monkeypatch):
    """bf16 blocks in bf16 where the caller says the CPU multiplies bf16 natively, in fp32 where it
    says not (CPU_HALF_IN_FP32, the models' decision passed down); outputs and gradients come back
    in bf16, the lse in fp32, both branches on any CPU."""
    monkeypatch.setattr(kernels, "CPU_HALF_IN_FP32", not bf16_units)
    q, k, v, dout = random_qkv(2, 4, 2, 20, 32, 16, dtype=torch.bfloat16)
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, dout, scale=0.3)
    with torch.profiler.profile(record_shapes=True) as prof:
        out, lse, dq, dk, dv = _run(attention_forward, attention_backward, q, k, v, dout, True, 0.3)
    flash = [e for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_flash_attention_for_cpu")]
    assert len(flash) == 2 and {e.input_dtypes[0] for e in flash} == {"c10::BFloat16" if bf16_units else "float"}
    assert lse.dtype == torch.float32 and {t.dtype for t in (out, dq, dk, dv)} == {torch.bfloat16}
    for got, want in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


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


def test_gpu_route_keeps_bf16_blocks_in_bf16_without_bf16_units(monkeypatch):
    """Under gpu_route (a planner tracing a GPU's step on the CPU device) a CPU without bf16 units
    runs the flash kernel in bf16, as a GPU does; the route ends with the block."""
    monkeypatch.setattr(kernels, "CPU_HALF_IN_FP32", True)
    q, k, v, dout = random_qkv(2, 4, 2, 20, 32, 16, dtype=torch.bfloat16)
    with kernels.gpu_route():
        with torch.profiler.profile(record_shapes=True) as prof:
            _run(attention_forward, attention_backward, q, k, v, dout, True, 0.3)
    flash = [e for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_flash_attention_for_cpu")]
    assert len(flash) == 2 and {e.input_dtypes[0] for e in flash} == {"c10::BFloat16"}
    assert not kernels.GPU_ROUTE and kernels._cpu_in_fp32(q)
