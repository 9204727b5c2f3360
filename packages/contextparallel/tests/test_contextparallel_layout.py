"""Layouts and block plans, checked on one process: every rank's blocks, merged through the lse,
give exactly its rows of full causal attention, and their backward sums to the full gradient."""

import itertools

import pytest
import torch
from cp_reference import random_qkv, reference_with_grads

from plait.contextparallel import SequenceLayout, plan_blocks, shard_batch, shard_sequence, unshard_sequence
from plait.contextparallel.blockwise import blocks_backward, blocks_forward
from plait.contextparallel.kernels import MergedAttention


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_shard_unshard_and_positions(cp, load_balance, rounds):
    layout = SequenceLayout(cp, load_balance, rounds)
    assert layout.n_chunks == 2 * cp * rounds and layout.chunks_per_rank == 2 * rounds
    seq = 4 * layout.n_chunks
    x = torch.arange(seq).view(1, seq)
    shards = [shard_sequence(x, 1, r, layout) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards, 1, layout), x)
    for r in range(cp):
        assert torch.equal(shards[r][0], layout.local_indices(r, seq))
        tokens, labels, positions = shard_batch(x, x + 1, r, layout)
        assert torch.equal(tokens, shards[r]) and torch.equal(labels, shards[r] + 1)
        assert torch.equal(positions, shards[r][0])
    # The index tensors the attention reorders by: the Python orders, built once per device.
    assert layout.rank_order_index().tolist() == layout.rank_order()
    assert layout.natural_order_index().tolist() == layout.natural_order()
    assert [layout.rank_order()[i] for i in layout.natural_order()] == list(range(layout.n_chunks))
    assert SequenceLayout(cp, load_balance, rounds).natural_order_index("cpu") is layout.natural_order_index()
    held = sorted(c for r in range(cp) for c in layout.chunks(r))
    assert held == list(range(layout.n_chunks))
    for r in range(cp):  # every buffer holds its chunks ascending (the plans rely on it)
        assert list(layout.chunks(r)) == sorted(layout.chunks(r)) and len(layout.chunks(r)) == 2 * rounds
        if load_balance:  # round j: chunks r and 2cp-1-r of [2cp j, 2cp (j + 1))
            assert layout.chunks(r) == tuple(c + 2 * cp * j for j in range(rounds) for c in (r, 2 * cp - 1 - r))
        else:  # contiguous: the same tokens whatever the rounds
            assert torch.equal(layout.local_indices(r, seq), SequenceLayout(cp, False).local_indices(r, seq))
    with pytest.raises(ValueError, match="not divisible by 2 x cp"):
        shard_sequence(torch.arange(seq + 1).view(1, -1), 1, 0, layout)


def _old_layout(cp, load_balance):
    """The layout before rounds existed (0.1.0): chunks and index formulas, written out."""
    chunks = [(r, 2 * cp - 1 - r) if load_balance else (2 * r, 2 * r + 1) for r in range(cp)]
    c = torch.arange(2 * cp)
    if not load_balance:
        return chunks, c, c
    return chunks, torch.where(c % 2 == 0, c // 2, 2 * cp - 1 - c // 2), torch.where(c < cp, 2 * c, 4 * cp - 1 - 2 * c)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("load_balance", [True, False])
def test_one_round_is_the_layout_and_plans_of_before(cp, load_balance):
    chunks, rank_order, natural_order = _old_layout(cp, load_balance)
    layout = SequenceLayout(cp, load_balance, rounds=1)
    assert layout == SequenceLayout(cp, load_balance)
    assert [layout.chunks(r) for r in range(cp)] == chunks
    assert torch.equal(layout.rank_order_index(), rank_order) and torch.equal(layout.natural_order_index(), natural_order)
    # Plans are a function of the chunks only: the same chunks give the same kernel calls.
    for r, src in itertools.product(range(cp), range(cp)):
        assert plan_blocks(layout.chunks(r), layout.chunks(src)) == plan_blocks(chunks[r], chunks[src])


def test_causal_plans_of_before_snapshot_and_rounds_call_counts():
    """cp 4, rank 1: the plans 0.1.0 made (literal), and how many calls more rounds cost."""
    t = lambda blocks: [(b.q0, b.q1, b.k0, b.k1, b.causal) for b in blocks]  # noqa: E731
    layout = SequenceLayout(4, True)
    assert t(plan_blocks(layout.chunks(1), range(8))) == [
        (0, 1, 1, 2, True), (1, 2, 6, 7, True), (0, 1, 0, 1, False), (1, 2, 0, 6, False)
    ]  # fmt: skip
    assert [t(plan_blocks(layout.chunks(1), layout.chunks((1 - s) % 4))) for s in range(4)] == [
        [(0, 2, 0, 2, True)], [(0, 2, 0, 1, False)], [(1, 2, 0, 2, False)], [(1, 2, 0, 2, False)]
    ]  # fmt: skip
    # rounds k (cp 4): all-gather 2 calls per held chunk at most (one diagonal square, one full run of
    # earlier keys; adjacent chunks merge), the ring 1 call for its own step and k for every other.
    for k in (1, 2, 4):
        layout = SequenceLayout(4, True, k)
        for r in range(4):
            assert len(plan_blocks(layout.chunks(r), range(layout.n_chunks))) <= 4 * k
            steps = [len(plan_blocks(layout.chunks(r), layout.chunks((r - s) % 4))) for s in range(4)]
            assert steps == [1] + [k] * 3, (k, r, steps)
    # Rank 0's chunk 2cp-1 and the next round's chunk 2cp are adjacent: one square for both.
    assert len(plan_blocks(SequenceLayout(4, True, 4).chunks(0), range(32))) == 9


def _causal_pairs(layout, rank, blocks, kv_chunks, chunk):
    """(visible, computed) token pairs of these blocks: each block's cost vs what it contributes."""
    q_chunks = layout.chunks(rank)
    computed = visible = 0
    for b in blocks:
        n = (b.q1 - b.q0) * chunk * (b.k1 - b.k0) * chunk
        computed += (n + (b.q1 - b.q0) * chunk) // 2 if b.causal else n
        for i in range(b.q0, b.q1):
            for j in range(b.k0, b.k1):
                a, c = q_chunks[i], kv_chunks[j]
                visible += chunk * chunk if c < a else (chunk * (chunk + 1) // 2 if c == a else 0)
    return visible, computed


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_plans_skip_masked_blocks_and_balance_work(cp, rounds):
    chunk = 4
    for load_balance in (True, False):
        layout = SequenceLayout(cp, load_balance, rounds)
        work = []
        for rank in range(cp):
            total = 0
            for src in range(cp):
                blocks = plan_blocks(layout.chunks(rank), layout.chunks(src))
                visible, computed = _causal_pairs(layout, rank, blocks, layout.chunks(src), chunk)
                # A causal square computes its masked upper half only in the kernel's own tiles;
                # every non-causal block is fully visible: nothing masked is ever computed.
                assert all(b.causal or all(
                    layout.chunks(src)[j] < layout.chunks(rank)[i] for i in range(b.q0, b.q1) for j in range(b.k0, b.k1)
                ) for b in blocks)
                assert visible <= computed
                total += visible
            work.append(total)
        if load_balance:
            assert len(set(work)) == 1, work
        else:
            assert work[-1] > work[0]
    # The ring's own step is one causal call; a rank's ascending pair needs no more.
    assert plan_blocks((1, 6), (1, 6)) == [plan_blocks((1, 6), (1, 6))[0]]
    assert len(plan_blocks((1, 6), (1, 6))) == 1


@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("load_balance, rounds", [(True, 1), (False, 1), (True, 2), (True, 3)])
@pytest.mark.parametrize("heads", [(4, 2, 16, 16), (2, 2, 24, 16)])  # GQA; MLA-like Dqk != Dv
def test_blocks_merge_to_full_attention(method, cp, load_balance, rounds, heads):
    H, G, dqk, dv = heads
    chunk, scale = 3, 0.37
    layout = SequenceLayout(cp, load_balance, rounds)
    S = layout.n_chunks * chunk
    q, k, v, dout = random_qkv(2, H, G, S, dqk, dv, dtype=torch.float64)
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, dout, scale)

    outs, dqs = [], []
    dk_full, dv_full = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        q_r, dout_r = (shard_sequence(t, 2, rank, layout) for t in (q, dout))
        if method == "allgather":
            pieces = [(k, v, plan_blocks(layout.chunks(rank), range(layout.n_chunks)), None)]
        else:
            pieces = [
                (shard_sequence(k, 2, src, layout), shard_sequence(v, 2, src, layout),
                 plan_blocks(layout.chunks(rank), layout.chunks(src)), src)
                for src in range(cp)
            ]
        acc = MergedAttention(q_r, dv)
        for k_p, v_p, blocks, _ in pieces:
            blocks_forward(acc, q_r, k_p, v_p, blocks, chunk, scale)
        out_r = acc.out.to(q.dtype)
        outs.append(out_r)
        dq_r = torch.zeros_like(q_r)
        for k_p, v_p, blocks, src in pieces:
            dk_p, dv_p = torch.zeros_like(k_p), torch.zeros_like(v_p)
            blocks_backward(dq_r, dk_p, dv_p, dout_r, q_r, k_p, v_p, out_r, acc.lse, blocks, chunk, scale)
            if src is None:
                dk_full += dk_p
                dv_full += dv_p
            else:
                idx = layout.local_indices(src, S)
                dk_full[:, :, idx] += dk_p
                dv_full[:, :, idx] += dv_p
        dqs.append(dq_r)
    torch.testing.assert_close(unshard_sequence(outs, 2, layout), ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(unshard_sequence(dqs, 2, layout), ref_dq, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dk_full, ref_dk, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dv_full, ref_dv, atol=1e-10, rtol=1e-10)
