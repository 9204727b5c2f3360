"""What a GPU would see of a context-parallel step, checked on CPU.

1. Every attention kernel call, forward and backward, for all three methods (with and without load
   balancing, GQA, MQA, MLA head dims, fp32 and bf16), gets inputs that meet the CUDA flash
   kernels' preconditions (`kernels.flash_input_problems`): a dense log-sum-exp, dense K/V, last-dim
   stride 1. CPU kernels honour any strides, so only this check sees a violation.
2. No host syncs in any step, the first included (it builds the layout's chunk-order indices, once
   per device, from arange on the device): no tensor from Python data, nothing read back.
   With document masking: exactly one (declared) host read of the rows' segments in the first step
   of a document_positions tensor, none after; rows of one document each make exactly the causal
   kernel calls.
3. Two head-tail rounds (`SequenceLayout(cp, rounds=2)`: causal and packed documents, fp32 and
   bf16): the same preconditions and no syncs, and causal kernel calls per rank as counted here.
Both are also checked by the repository's StepSentinel (plait.testing.sentinel) when it is present.
"""

import itertools

import torch
from cp_reference import (
    document_reference_with_grads,
    packed_rows,
    positions_from_lengths,
    random_qkv,
    reference_with_grads,
)
from cp_sentinels import HostDataCounter, KernelInputCheck

from plait.contextparallel import ContextParallelAttention, SequenceLayout, layout, shard_sequence
from plait.contextparallel.blockwise import blocks_backward
from plait.contextparallel.kernels import MergedAttention, attention_forward
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

SHAPES = {"gqa": (4, 2, 16, 16), "mqa": (4, 1, 16, 16), "mla": (4, 4, 24, 16)}  # (H, G, Dqk, Dv)
METHODS = ("allgather", "ring", "ulysses")
# documents: None (causal), "packed" (packed_rows), "one_per_row" (one document per row, mid-document starts);
# load balance: True (head-tail), False (contiguous) or 2 (head-tail, two rounds)
CASES = (
    [(method, lb, shape, torch.float32, None) for method, lb, shape in itertools.product(METHODS, (True, False), SHAPES)]
    + [(method, True, "gqa", torch.bfloat16, None) for method in METHODS]
    + [(method, True, shape, torch.float32, "packed") for method, shape in itertools.product(METHODS, ("mqa", "mla"))]
    + [(method, True, "gqa", torch.bfloat16, "packed") for method in METHODS]
    + [(method, True, "gqa", torch.float32, "one_per_row") for method in METHODS]
    + [(method, 2, shape, dtype, documents) for method, (shape, dtype), documents in itertools.product(
        METHODS, (("gqa", torch.bfloat16), ("mla", torch.float32)), (None, "packed"))]
)
# Causal kernel calls (forward, backward) per rank at cp 2, one round vs two. All-gather: a diagonal
# square per run of adjacent held chunks and a full block per run's earlier keys (rank 0 holds 0, 3
# | 4, 7: squares 0, 3-4, 7; rank 1 holds 1-2 | 5-6: squares 1-2, 5-6, the first sharing keys
# [0, 1)); ring: 1 call for its own chunks, 1 per round for the other rank's.
CAUSAL_CALLS = {("allgather", True): [(3, 3), (2, 2)], ("allgather", 2): [(5, 5), (4, 4)],
                ("ring", True): [(2, 2), (2, 2)], ("ring", 2): [(3, 3), (3, 3)]}


def _positions(documents, world_size):
    S = 2 * world_size * 8
    if documents == "packed":
        return packed_rows(8, world_size)
    lengths = [[S], [S]]
    return torch.stack([positions_from_lengths([S], first_offset=5), positions_from_lengths([S])]), lengths


def _sentinel_class():
    """The repository's step sentinel, when it exists (plait.testing.sentinel); else None."""
    try:
        from plait.testing.sentinel import StepSentinel
    except ImportError:
        return None
    return StepSentinel


def _step(attention, local, dout, positions=None):
    for t in local:
        t.grad = None
    out = attention(*local, positions)
    out.backward(dout)
    return out


def _watch(rank, world_size):
    meshes = build_meshes(ParallelDims(dp_shard=1, cp=world_size, world_size=world_size))
    sentinel_cls = _sentinel_class()
    report = {}
    for n, (method, load_balance, shape, dtype, documents) in enumerate(CASES):
        H, G, dqk, dv = SHAPES[shape]
        cp_layout = SequenceLayout(world_size, bool(load_balance), 2 if load_balance == 2 else 1)
        q, k, v, dout = random_qkv(2, H, G, 2 * world_size * 8, dqk, dv, dtype=dtype, seed=n)
        positions, lengths = _positions(documents, world_size) if documents else (None, None)
        if documents:
            ref = document_reference_with_grads(q, k, v, dout, lengths, scale=0.25)
        else:
            ref = reference_with_grads(q, k, v, dout, scale=0.25)
        # As the models pass them: transposed views of [B, S, heads, D] projections.
        local = [shard_sequence(t, 2, rank, cp_layout).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        local = [t.requires_grad_() for t in local]
        dout_r = shard_sequence(dout, 2, rank, cp_layout)
        attention = ContextParallelAttention(meshes.cp, method, cp_layout, scale=0.25)
        layout._order_indices.cache_clear()  # this case's first step builds its index tensors
        steps = []
        for _ in range(2):
            check, host = KernelInputCheck(), HostDataCounter()
            with check, host:
                out = _step(attention, local, dout_r, positions)
            steps.append((check.forward_calls, check.backward_calls, check.problems, host.calls))
        sentinel = None
        if sentinel_cls is not None:  # the repository's sentinel, over two more steps from a cold cache
            layout._order_indices.cache_clear()
            fresh = None if positions is None else positions.clone()  # its segments not read yet
            s = sentinel_cls(torch.device("cpu"))
            for _ in range(2):
                with s:
                    _step(attention, local, dout_r, fresh)
            sentinel = (s.step_counts(), [tuple(r) for r in s.host_syncs], [tuple(r) for r in s.violations])
        got = [out.detach(), *(t.grad for t in local)]
        err = max((g.double() - shard_sequence(r, 2, rank, cp_layout)).abs().max().item() for g, r in zip(got, ref))
        report[(method, load_balance if load_balance == 2 else bool(load_balance), shape, str(dtype), documents)] = (
            steps, err, sentinel
        )
    return report


def test_kernel_inputs_meet_cuda_preconditions_and_steps_do_not_sync():
    reports = run_on_ranks(_watch, 2, timeout=400)
    for rank_report in reports:
        for case, (steps, err, sentinel) in rank_report.items():
            assert err < (1e-5 if "float32" in case[3] else 5e-2), (case, err)
            for fwd, bwd, problems, _host in steps:
                assert fwd > 0 and bwd > 0, case  # the mode saw the kernels
                assert problems == [], (case, problems)
            host = [[c.split(" at ")[0] + (" documents.py" if "documents.py" in c else "") for c in h] for *_, h in steps]
            if case[4] is None:
                # Not even the first step, which builds the chunk-order indices (on the device, from arange).
                assert host == [[], []], (case, steps)
            else:
                # The one declared read of the rows' segments, and the documents' offsets built from
                # them on the host (blockwise.Diagonal: copied to the device non-blocking, no sync),
                # both cached on the tensor for the next step.
                # Rows of one document each take the causal plan: no offsets.
                first = ["nonzero documents.py"] + (["tensor from Python data"] if case[4] != "one_per_row" else [])
                assert host == [first, []], (case, steps)
            if sentinel is not None:
                counts, syncs, violations = sentinel
                assert violations == [], (case, violations)
                if case[4] is None:
                    assert syncs == [] and counts == [(0, 0), (0, 0)], (case, syncs, counts)
                else:
                    assert counts[1] == (0, 0) and counts[0][1] == 0 and counts[0][0] >= 1, (case, counts)
                    assert all("declared:" in str(r) for r in syncs), (case, syncs)
        # One document per row is causal attention: the very same kernel calls as document_positions=None.
        for method in METHODS:
            causal = [(f, b) for f, b, *_ in rank_report[(method, True, "gqa", "torch.float32", None)][0]]
            one_doc = [(f, b) for f, b, *_ in rank_report[(method, True, "gqa", "torch.float32", "one_per_row")][0]]
            assert causal == one_doc, (method, causal, one_doc)
    # More rounds, more (smaller) causal calls: counted per rank and method.
    for (method, rounds), per_rank in CAUSAL_CALLS.items():
        dtype = "torch.float32" if rounds is True else "torch.bfloat16"
        for rank, rank_report in enumerate(reports):
            steps = rank_report[(method, rounds, "gqa", dtype, None)][0]
            assert [(f, b) for f, b, *_ in steps] == [per_rank[rank]] * 2, (method, rounds, rank, steps)


def test_checks_see_what_the_cuda_kernels_would_break():
    """The checks are not vacuous: an lse slice, K/V columns of a [K | V] buffer, torch.tensor and
    .item() are each caught; the same block through blocks_backward is clean."""
    q, k, v, dout = random_qkv(2, 4, 2, 12, 16, 16)
    acc = MergedAttention(q, 16)
    acc.lse.copy_(torch.randn(acc.lse.shape))
    out = torch.randn(2, 4, 12, 16)
    kv = torch.cat([k, v], dim=-1)
    check = KernelInputCheck()
    with check:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv[..., :16], kv[..., 16:], 0.0, True, scale=0.3)
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, 4:], q[:, :, 4:], k, v, out[:, :, 4:], acc.lse[:, :, 4:], 0.0, False, scale=0.3
        )
    assert check.forward_calls == 1 and check.backward_calls == 1
    assert any("k: row stride 32" in p for p in check.problems), check.problems
    assert any("v: row stride 32" in p for p in check.problems), check.problems
    assert any("lse: not contiguous" in p for p in check.problems), check.problems
    # attention_forward hands back a dense lse whatever the kernel returns (the CPU one: a transposed view).
    assert attention_forward(q, k, v, True, 0.3)[1].is_contiguous()
    # Our blocks hand the same slices over made dense.
    check = KernelInputCheck()
    with check:
        blocks_backward(
            torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dout, q, k, v, out, acc.lse,
            [layout.Block(1, 2, 0, 1, False)], 6, 0.3,
        )
    assert check.backward_calls == 1 and check.problems == []
    host = HostDataCounter()
    with host:
        torch.tensor([1, 2])
        torch.ones(3).sum().item()
    assert [c.split(" at ")[0] for c in host.calls] == ["tensor from Python data", "read to the host (.item() / bool())"]
    assert all(__file__ in c for c in host.calls), host.calls
