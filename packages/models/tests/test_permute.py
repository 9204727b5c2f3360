"""The permute-indices kernel: torch and Triton (interpreted on CPU) against the Python reference."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from plait.models.moe import GroupedExperts, permute_and_pad, unpermute
from plait.models.moe.kernels import (
    default_max_len,
    permute_indices_reference,
    permute_indices_torch,
)


def _count_vectors(n: int = 40, seed: int = 0):
    """Random (counts, ep_degree, num_local_experts, alignment) cases, edge cases first."""
    yield torch.tensor([0, 0, 0, 0], dtype=torch.int32), 2, 2, 16  # nothing received
    yield torch.tensor([7, 3, 0, 0, 0, 0], dtype=torch.int32), 3, 2, 32  # one rank sends all
    yield torch.tensor([0, 5, 0, 9], dtype=torch.int32), 2, 2, 1  # expert 0 empty
    yield torch.tensor([16, 32, 0, 16], dtype=torch.int32), 2, 2, 16  # already aligned
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        ep = int(torch.randint(1, 9, (1,), generator=g))
        experts = int(torch.randint(1, 9, (1,), generator=g))
        counts = torch.randint(0, 50, (ep * experts,), generator=g, dtype=torch.int32)
        counts[torch.rand(ep * experts, generator=g) < 0.3] = 0
        if i % 5 == 0:  # one rank receives everything... from a single source rank
            counts.view(ep, experts)[1:] = 0
        yield counts, ep, experts, (1, 16, 32)[i % 3]


def _check_layout(counts, ep, experts, alignment, permuted, m_sizes, m_offsets):
    """Structural checks on the reference itself, so the spec is not only self-consistent."""
    assert torch.all(m_sizes % alignment == 0)
    assert torch.equal(m_offsets, torch.cumsum(m_sizes, 0, dtype=torch.int32))
    real = permuted[permuted >= 0]
    assert torch.equal(real.sort().values, torch.arange(int(counts.sum())))  # each row once
    counts_RE = counts.view(ep, experts).long()
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), m_offsets[:-1].long()])
    src_start = (torch.cumsum(counts.long(), 0) - counts.long()).view(ep, experts)
    for e in range(experts):
        group = permuted[starts[e] : m_offsets[e]]
        expected = torch.cat([torch.arange(c) + s for c, s in zip(counts_RE[:, e], src_start[:, e])])
        assert torch.equal(group[: len(expected)], expected)  # rank order within the expert
        assert torch.all(group[len(expected) :] == -1)
        assert m_sizes[e] - len(expected) < alignment  # minimal padding


def test_reference_layout():
    for counts, ep, experts, alignment in _count_vectors(15):
        max_len = default_max_len(int(counts.sum()), experts, alignment)
        out = permute_indices_reference(counts, ep, experts, max_len, alignment)
        _check_layout(counts, ep, experts, alignment, *out)
        assert torch.all(out[0][int(out[2][-1]) :] == -1)


def test_torch_matches_reference():
    for counts, ep, experts, alignment in _count_vectors():
        max_len = default_max_len(int(counts.sum()), experts, alignment) + 5  # slack rows
        expected = permute_indices_reference(counts, ep, experts, max_len, alignment)
        got = permute_indices_torch(counts, ep, experts, max_len, alignment)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and torch.equal(g, e), (counts, ep, experts, alignment)


def test_torch_kernel_needs_no_host_sync():
    counts = torch.empty(12, dtype=torch.int32, device="meta")
    permuted, m_sizes, m_offsets = permute_indices_torch(counts, 3, 4, 128, 16)
    assert permuted.shape == (128,) and m_sizes.shape == m_offsets.shape == (4,)


_TRITON_CHECK = """
import torch
from plait.models.moe.kernels import default_max_len, permute_indices_reference
from plait.models.moe.triton_kernels import permute_indices_triton
from test_permute import _count_vectors
for counts, ep, experts, alignment in _count_vectors(25):
    max_len = default_max_len(int(counts.sum()), experts, alignment) + 3
    expected = permute_indices_reference(counts, ep, experts, max_len, alignment)
    got = permute_indices_triton(counts, ep, experts, max_len, alignment)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e), (counts, ep, experts, alignment, g, e)
print("triton ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_matches_reference_interpreted():
    # The interpreter must be chosen before triton is imported, hence a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK],
        cwd=os.path.dirname(__file__),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "triton ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("alignment", [1, 16, 32])
def test_permute_pad_unpermute_round_trip_and_gradients(alignment):
    counts = torch.tensor([3, 0, 5, 2, 4, 1], dtype=torch.int32)  # ep 2 x 3 local experts
    x = torch.randn(int(counts.sum()), 8, requires_grad=True)
    x_padded, permuted, m_sizes = permute_and_pad(x, counts, 2, 3, alignment=alignment)
    assert torch.all(x_padded[permuted < 0] == 0)
    torch.testing.assert_close(x_padded[permuted >= 0], x[permuted[permuted >= 0]])
    back = unpermute(x_padded * 2, permuted, x.shape[0])
    torch.testing.assert_close(back, x * 2)
    back.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize("alignment", [16, 32])
def test_grouped_experts_on_padded_layout_equal_unpadded(alignment):
    torch.manual_seed(0)
    ep, experts, dim = 2, 3, 32
    module = GroupedExperts(dim, 48, experts)
    module.init_weights(0.5)
    counts = torch.tensor([3, 0, 5, 2, 4, 1], dtype=torch.int32)
    x = torch.randn(int(counts.sum()), dim)

    # Unpadded: reorder expert-major by hand, run, restore.
    order = permute_indices_reference(counts, ep, experts, x.shape[0], 1)[0]
    per_expert = counts.view(ep, experts).sum(0)
    y_sorted = module(x[order], per_expert)
    expected = torch.empty_like(y_sorted)
    expected[order] = y_sorted

    x_padded, permuted, m_sizes = permute_and_pad(x, counts, ep, experts, alignment=alignment)
    y = unpermute(module(x_padded, m_sizes), permuted, x.shape[0])
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
