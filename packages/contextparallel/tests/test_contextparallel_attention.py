"""Context-parallel attention on 2 and 4 gloo ranks against full single-process attention.

Every method (allgather, ring, ulysses), with and without load balancing, for GQA (4 query heads
over 2 kv heads: Ulysses at cp 4 repeats kv heads) and MLA head dims (q/k 24, v 16): each rank's
output rows and its q/k/v gradients equal those of fp64 attention over the whole sequence
(fp32 within 1e-5; bf16 within bf16 tolerance). One spawn per world size runs every case.

The defining test of document masking rides in the same spawns: packed rows (B=2, differently
segmented; a row starting mid-document, documents of 1 token, exactly a chunk, longer than a rank's
share) through every method, output and q/k/v gradients equal to each document alone through plain
causal F.scaled_dot_product_attention (fp32, GQA with H != G, MLA-like Dv < Dqk).
Both run again at load_balance rounds = 2 (2 x cp x 2 chunks, head-tail per round), every method
and head shape, through a layout from `apply_context_parallel` with `load_balance_rounds=2`.
The 2-rank spawn also runs a user's attention layer that calls F.scaled_dot_product_attention
through `ContextParallelSDPA` (patched, passed, transformers' signature; `cp_byom.py`).
"""

import itertools

import pytest
import torch
from cp_byom import MODES, byom_errors
from cp_reference import document_reference_with_grads, packed_rows, random_qkv, reference_with_grads

from plait.contextparallel import (
    ContextParallelAttention,
    ContextParallelConfig,
    SequenceLayout,
    apply_context_parallel,
    shard_sequence,
)
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

SHAPES = {"gqa": (4, 2, 16, 16), "mla": (4, 4, 24, 16)}  # (H, G, Dqk, Dv)
METHODS = ("allgather", "ring", "ulysses")


def _cases(world_size):
    """(method, load_balance, shape, dtype, documents, rounds)"""
    cases = [(m, lb, s, torch.float32, False, 1) for m, lb, s in itertools.product(METHODS, (True, False), SHAPES)]
    if world_size == 2:
        cases += [(m, True, "gqa", torch.bfloat16, False, 1) for m in METHODS]
    # Document masking: every method, both head shapes, head-tail and contiguous.
    cases += [(m, True, s, torch.float32, True, 1) for m, s in itertools.product(METHODS, SHAPES)]
    cases += [(m, False, "gqa", torch.float32, True, 1) for m in METHODS]
    # Two head-tail rounds, causal and documents: every method, both head shapes.
    cases += [(m, True, s, torch.float32, d, 2) for m, s, d in itertools.product(METHODS, SHAPES, (False, True))]
    return cases


def _rounds_layout(cp_mesh, method, rounds):
    """The layout and module apply_context_parallel installs for `load_balance_rounds=rounds`."""
    model = torch.nn.Module()
    model.attention = torch.nn.Module()
    model.attention.sdpa = torch.nn.Module()
    model.attention.sdpa.scale = 0.2
    layout = apply_context_parallel(
        model, cp_mesh, ["attention.sdpa"], ContextParallelConfig(method, load_balance_rounds=rounds)
    )
    assert layout == SequenceLayout(cp_mesh.size(), True, rounds) and model.attention.sdpa.layout is layout
    return layout, model.attention.sdpa


def _errors(rank, world_size):
    meshes = build_meshes(ParallelDims(dp_shard=1, cp=world_size, world_size=world_size))
    errors = {}
    for method, load_balance, shape, dtype, documents, rounds in _cases(world_size):
        H, G, dqk, dv = SHAPES[shape]
        layout = SequenceLayout(world_size, load_balance)
        attention = ContextParallelAttention(meshes.cp, method, layout, scale=0.2)
        if rounds > 1:
            layout, attention = _rounds_layout(meshes.cp, method, rounds)
        S = 2 * world_size * 8
        q, k, v, dout = random_qkv(2, H, G, S, dqk, dv, dtype=dtype, seed=len(errors))
        positions, lengths = packed_rows(8, world_size) if documents else (None, None)
        if documents:
            ref = document_reference_with_grads(q, k, v, dout, lengths, scale=0.2)
        else:
            ref = reference_with_grads(q, k, v, dout, scale=0.2)
        # Local shards, laid out as the models pass them (transposed [B, S, H, D] views).
        local = [shard_sequence(t, 2, rank, layout).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        local = [t.requires_grad_() for t in local]
        out = attention(*local, positions)  # the full rows' document positions, or None (causal)
        out.backward(shard_sequence(dout, 2, rank, layout))
        got = [out.detach(), *(t.grad for t in local)]
        assert all(g.dtype == dtype for g in got)
        errors[(method, load_balance, shape, str(dtype), documents, rounds)] = [
            (g.double() - shard_sequence(r, 2, rank, layout)).abs().max().item() for g, r in zip(got, ref)
        ]
    if world_size == 2:
        errors.update(byom_errors(rank, meshes.cp))
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_matches_full_attention(world_size):
    results = run_on_ranks(_errors, world_size, timeout=180)
    for errors in results:
        assert sum(case[4] for case in errors if case[0] != "byom") == 15  # the document cases ran
        assert sum(case[5] == 2 for case in errors if case[0] != "byom") == 12  # and the two-round ones
        assert sum(case[0] == "byom" for case in errors) == (3 * len(MODES) if world_size == 2 else 0)
        for case, errs in errors.items():
            tol = 5e-2 if "torch.bfloat16" in case else 1e-5
            assert max(errs) < tol, (case, errs)
