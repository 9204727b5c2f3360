"""What the CUDA path of the MoE relies on, checked on the CPU with the same tensors.

- One group padding rule (kernels.GROUP_ALIGNMENT) also at ep = 1: the grouped GEMM only ever sees
  groups whose starts are multiples of it, and the result equals the per-expert loop.
- Under deterministic algorithms (training.deterministic) the combine is token-major (gather +
  sum over K), never a float scatter_add: equal to the scatter_add form, gradients too, bitwise
  repeatable.
- The sync-free Triton grouped GEMM (fp32 / non-Hopper CUDA) against torch._grouped_mm, forward and
  backward, under TRITON_INTERPRET=1.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from plait.models.moe import GroupedExperts, MoE, TokenChoiceTopKRouter
from plait.models.moe.experts import run_experts_for_loop
from plait.models.moe.kernels import GROUP_ALIGNMENT, group_alignment
from plait.models.moe.moe import _GatherTokens, _PermuteRows

DIM, HIDDEN, E = 32, 48, 6


class _GroupedMMOffsets(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.offsets = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # plait's op too: bf16 on a CPU that emulates it runs through it (cpu_bf16.py).
        if func in (torch.ops.aten._grouped_mm.default, torch.ops.plait.grouped_mm.default):
            self.offsets.append((kwargs or {}).get("offs", args[2] if len(args) > 2 else None).tolist())
        return func(*args, **(kwargs or {}))


def test_the_rule_is_16_bytes_of_rows_and_one_number_for_every_unscaled_dtype():
    assert group_alignment(torch.bfloat16) == 8 and group_alignment(torch.float16) == 8
    assert group_alignment(torch.float32) == 4 and group_alignment(torch.float8_e4m3fn) == 16
    assert GROUP_ALIGNMENT == 8 and GroupedExperts.group_alignment == GROUP_ALIGNMENT


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_ep1_groups_are_padded_to_the_rule_and_match_the_loop(dtype, tol):
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, E)
    experts.init_weights(0.5)
    experts.to(dtype)
    counts = torch.tensor([5, 0, 9, 1, 0, 17])
    x = torch.randn(int(counts.sum()) + 3, DIM, dtype=dtype)  # 3 rows past the groups
    xg = x.clone().requires_grad_()
    with _GroupedMMOffsets() as seen:
        y = experts(xg, counts)
        y.backward(torch.ones_like(y))
    assert seen.offsets, "grouped_mm did not run"
    for offs in seen.offsets:  # forward and backward calls alike
        assert all(o % GROUP_ALIGNMENT == 0 for o in offs), offs
    xr = x.clone().requires_grad_()
    w = [p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2, experts.w3)]
    y_ref = run_experts_for_loop(*w, xr, counts)
    y_ref.backward(torch.ones_like(y_ref))
    scale = float(y_ref.detach().abs().max())
    torch.testing.assert_close(y, y_ref, atol=tol * scale, rtol=tol)
    assert torch.all(y[-3:] == 0) and torch.all(xg.grad[-3:] == 0)
    torch.testing.assert_close(xg.grad, xr.grad, atol=tol * float(xr.grad.abs().max()), rtol=tol)
    for p, r in zip((experts.w1, experts.w2, experts.w3), w):
        torch.testing.assert_close(p.grad, r.grad, atol=tol * float(r.grad.abs().max()), rtol=tol)


def test_permute_rows_backward_is_the_inverse_gather():
    x = torch.randn(6, 3, requires_grad=True)
    index = torch.tensor([4, 0, 5, 1, 3, 2])
    inverse = torch.empty_like(index).scatter_(0, index, torch.arange(6))
    g = torch.randn(6, 3)
    _PermuteRows.apply(x, index, inverse).backward(g)
    torch.testing.assert_close(x.grad, torch.zeros(6, 3).index_add_(0, index, g))


def test_token_gather_backward_is_the_token_major_sum_of_index_put():
    torch.manual_seed(0)
    T, K, D = 7, 3, 5
    x = torch.randn(T, D, requires_grad=True)
    sorted_pairs = torch.argsort(torch.randint(0, 4, (T * K,)), stable=True)
    rank = torch.empty_like(sorted_pairs).scatter_(0, sorted_pairs, torch.arange(T * K))
    g = torch.randn(T * K, D)
    _GatherTokens.apply(x, sorted_pairs, rank, K).backward(g)
    x_ref = x.detach().clone().requires_grad_()
    x_ref[sorted_pairs // K].backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)


def _moe_grads(moe, x, deterministic):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        xg = x.clone().requires_grad_()
        y = moe(xg)
        y.square().sum().backward()
        grads = [xg.grad] + [p.grad.clone() for p in moe.parameters()]
        moe.zero_grad()
        return y.detach(), grads
    finally:
        torch.use_deterministic_algorithms(previous)


def test_deterministic_combine_equals_the_scatter_add_form_and_repeats_bitwise():
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, E, 1, TokenChoiceTopKRouter(DIM, E, 2))
    moe.init_weights(0.3)
    x = torch.randn(2, 5, DIM)
    y_scatter, g_scatter = _moe_grads(moe, x, False)
    y_det, g_det = _moe_grads(moe, x, True)
    torch.testing.assert_close(y_det, y_scatter, atol=1e-6, rtol=1e-5)
    for a, b in zip(g_det, g_scatter):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    y_again, g_again = _moe_grads(moe, x, True)
    assert torch.equal(y_again, y_det) and all(torch.equal(a, b) for a, b in zip(g_again, g_det))


_TRITON_GMM = """
import torch
from plait.models.moe.triton_grouped_mm import triton_grouped_mm
torch.manual_seed(0)
for counts, K, N in (([5, 0, 40, 1], 16, 24), ([0, 0, 3], 8, 40), ([33], 20, 16)):
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    used = int(offs[-1])
    x = torch.randn(used + 3, K, requires_grad=True)  # 3 rows past the last group
    w = torch.randn(len(counts), K, N, requires_grad=True)
    y = triton_grouped_mm(x, w, offs)
    g = torch.randn_like(y)
    y.backward(g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch._grouped_mm(x2[:used], w2, offs=offs)
    ref.backward(g[:used])
    torch.testing.assert_close(y[:used], ref)
    torch.testing.assert_close(x.grad[:used], x2.grad[:used])
    torch.testing.assert_close(w.grad, w2.grad)
    assert (y[used:] == 0).all() and (x.grad[used:] == 0).all()
print("triton grouped mm ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_sync_free_triton_grouped_mm_matches_torch_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_GMM], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "triton grouped mm ok" in result.stdout, result.stderr[-3000:]


def test_loop_reference_uses_plain_matmuls():
    # The reference the padded path is checked against is the per-expert SwiGLU itself.
    torch.manual_seed(0)
    w1, w2, w3 = torch.randn(2, 4, 6), torch.randn(2, 6, 4), torch.randn(2, 4, 6)
    x = torch.randn(3, 4)
    y = run_experts_for_loop(w1, w2, w3, x, torch.tensor([1, 2]))
    expected = torch.cat([(F.silu(x[:1] @ w1[0]) * (x[:1] @ w3[0])) @ w2[0],
                          (F.silu(x[1:] @ w1[1]) * (x[1:] @ w3[1])) @ w2[1]])  # fmt: skip
    torch.testing.assert_close(y, expected)
