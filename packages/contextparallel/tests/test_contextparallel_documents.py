"""Document masking under context parallel, checked on one process: segments read from
document_positions, document plans (exactly the visible pairs, fully masked blocks never computed,
rows sharing calls, one-document rows = the causal plan), every method's per-rank blocks against
each document alone through F.scaled_dot_product_attention, and attention_work by hand.
The multi-rank runs of the real autograd functions are in test_contextparallel_attention.py."""

import itertools
import random

import pytest
import torch
from cp_reference import document_reference_with_grads, packed_rows, positions_from_lengths, random_qkv

from plait.contextparallel import (
    PerDocumentHeadTail,
    SequenceLayout,
    attention_work,
    document_segments,
    imbalance,
    plan_blocks,
    plan_document_blocks,
    shard_sequence,
    unshard_sequence,
)
from plait.contextparallel.blockwise import (
    Diagonal,
    blocks_backward,
    blocks_forward,
    diagonal_backward,
    diagonal_forward,
)
from plait.contextparallel.documents import boundaries_from_lengths, work
from plait.contextparallel.kernels import MergedAttention
from plait.contextparallel.layout import Block
from plait.contextparallel.ring import _plans


def test_segments_from_positions_are_read_once_and_cached_on_the_tensor():
    positions = torch.stack([positions_from_lengths([3, 1, 4], first_offset=5), positions_from_lengths([8])])
    assert positions[0].tolist() == [5, 6, 7, 0, 0, 1, 2, 3]
    segments = document_segments(positions)
    assert segments.boundaries == ((0, 3, 4, 8), (0, 8)) and segments.seq_len == 8 and segments.batch == 2
    assert not segments.single_document_rows
    assert document_segments(positions) is segments  # every layer and the backward reuse it
    assert segments.plan((0, 3), range(4), 2) is segments.plan((0, 3), range(4), 2)
    positions[1, 4] = 0  # refilled in place: read again
    assert document_segments(positions).boundaries == ((0, 3, 4, 8), (0, 4, 8))
    one_each = torch.stack([positions_from_lengths([8], first_offset=2), positions_from_lengths([8])])
    assert document_segments(one_each).single_document_rows


def _pairs(blocks, q_chunks, kv_chunks, chunk, batch):
    """Every (row, query position, key position) the blocks compute, with multiplicity: a causal
    square computes its lower triangle, a full block everything."""
    q_pos = [c * chunk + t for c in q_chunks for t in range(chunk)]
    kv_pos = [c * chunk + t for c in kv_chunks for t in range(chunk)]
    pairs = []
    for b in blocks:
        for row in range(b.b0, b.b1 if b.b1 is not None else batch):
            for i in range(b.q0, b.q1):
                for j in range(b.k0, b.k1):
                    if not b.causal or j - b.k0 <= i - b.q0:
                        pairs.append((row, q_pos[i], kv_pos[j]))
    return pairs


def _visible(boundaries, q_chunks, kv_chunks, chunk):
    seg = [[max(i for i, s in enumerate(bounds[:-1]) if s <= p) for p in range(bounds[-1])] for bounds in boundaries]
    return {
        (row, i, j)
        for row in range(len(boundaries))
        for i in (c * chunk + t for c in q_chunks for t in range(chunk))
        for j in (c * chunk + t for c in kv_chunks for t in range(chunk))
        if j <= i and seg[row][i] == seg[row][j]
    }


def _random_lengths(rng, S):
    lengths = []
    while sum(lengths) < S:
        lengths.append(min(rng.choice([1, 1, 2, 3, 5, 7, 11, 30]), S - sum(lengths)))
    return lengths


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance, rounds", [(True, 1), (False, 1), (True, 2), (True, 3)])
def test_document_plans_compute_exactly_the_visible_pairs(cp, load_balance, rounds):
    """allgather's plan and the ring's per-step plans compute each visible pair once and nothing masked
    (so fully masked blocks are never computed), and their work is the visible pair count."""
    rng, chunk = random.Random(cp), 3
    layout = SequenceLayout(cp, load_balance, rounds)
    S = layout.n_chunks * chunk
    for _ in range(6):
        rows = [_random_lengths(rng, S) for _ in range(3)]
        rows.append(list(rows[-1]))  # rows 2 and 3 alike: their calls are shared
        boundaries = [boundaries_from_lengths(r) for r in rows]
        for rank in range(cp):
            q_chunks = layout.chunks(rank)
            gathered = plan_document_blocks(q_chunks, range(layout.n_chunks), chunk, boundaries)
            ring = [(layout.chunks(src), plan_document_blocks(q_chunks, layout.chunks(src), chunk, boundaries))
                    for src in range(cp)]  # fmt: skip
            for pieces in ([(range(layout.n_chunks), gathered)], ring):
                computed, visible = [], set()
                for kv_chunks, blocks in pieces:
                    computed += _pairs(blocks, q_chunks, kv_chunks, chunk, len(rows))
                    visible |= _visible(boundaries, q_chunks, kv_chunks, chunk)
                    assert work(blocks, len(rows)) == len(_pairs(blocks, q_chunks, kv_chunks, chunk, len(rows)))
                assert len(computed) == len(set(computed)), "a pair computed twice"
                assert set(computed) == visible
            # Rows 2 and 3 are alike: every call of row 3 is shared with row 2 (a batch range).
            assert not any(b.b0 == 3 for b in gathered)
            assert all(b.q1 > b.q0 and b.k1 > b.k0 for b in gathered)


def test_one_document_rows_plan_is_the_causal_plan_and_masked_blocks_cost_nothing():
    layout, chunk = SequenceLayout(4, True), 5
    one_doc = [boundaries_from_lengths([40])] * 2
    for rank, src in itertools.product(range(4), range(4)):
        causal = plan_blocks(layout.chunks(rank), layout.chunks(src))
        scaled = [Block(b.q0 * chunk, b.q1 * chunk, b.k0 * chunk, b.k1 * chunk, b.causal, 0, 2) for b in causal]
        assert plan_document_blocks(layout.chunks(rank), layout.chunks(src), chunk, one_doc) == scaled
    # Documents of one chunk each: only the diagonal squares remain, every off-diagonal block skipped.
    per_chunk = [boundaries_from_lengths([chunk] * 8)]
    blocks = plan_document_blocks(layout.chunks(1), range(8), chunk, per_chunk)
    assert blocks == [Block(0, chunk, 1 * chunk, 2 * chunk, True, 0, 1), Block(chunk, 2 * chunk, 6 * chunk, 7 * chunk, True, 0, 1)]
    assert [plan_document_blocks(layout.chunks(1), layout.chunks(src), chunk, per_chunk) for src in (0, 2, 3)] == [[], [], []]


def _simulate(method, q, k, v, dout, layout, positions, scale):
    """Each rank's blocks (allgather, ring) or head-shard segments (Ulysses), on one process."""
    cp, chunk = layout.cp, q.shape[2] // layout.n_chunks
    segments = document_segments(positions)
    if method == "ulysses":  # every rank holds the whole sequence for its heads: one rank's worth
        blocks = segments.plan(range(layout.n_chunks), range(layout.n_chunks), chunk)
        diagonal, rest = Diagonal.split(segments, blocks, q.shape, "whole", q.device)
        assert rest == []  # every block of the whole sequence is a causal square: one call
        acc = MergedAttention(q, v.shape[-1])
        diagonal_forward(acc, q, k, v, diagonal, scale)
        out = acc.out.to(q.dtype)
        grads = diagonal_backward(dout, q, k, v, out, acc.lse, diagonal, scale)
        return (out, *(g.to(q.dtype) for g in grads)), len(blocks)
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    calls = 0
    for rank in range(cp):
        q_r, dout_r = (shard_sequence(t, 2, rank, layout) for t in (q, dout))
        if method == "allgather":
            pieces = [(k, v, segments.plan(layout.chunks(rank), range(layout.n_chunks), chunk), None)]
        else:
            steps = _plans(layout, rank, chunk, segments)
            pieces = [(shard_sequence(k, 2, (rank - s) % cp, layout), shard_sequence(v, 2, (rank - s) % cp, layout),
                       steps[s], (rank - s) % cp) for s in range(cp)]  # fmt: skip
        acc = MergedAttention(q_r, v.shape[-1])
        for k_p, v_p, blocks, _ in pieces:
            blocks_forward(acc, q_r, k_p, v_p, blocks, 1, scale)
            calls += len(blocks)
        assert torch.isfinite(acc.lse).all()  # every row saw at least its own token
        out_r = acc.out.to(q.dtype)
        dq_r = torch.zeros_like(q_r)
        for k_p, v_p, blocks, src in pieces:
            dk_p, dv_p = torch.zeros_like(k_p), torch.zeros_like(v_p)
            blocks_backward(dq_r, dk_p, dv_p, dout_r, q_r, k_p, v_p, out_r, acc.lse, blocks, 1, scale)
            idx = slice(None) if src is None else layout.local_indices(src, q.shape[2])
            dk[:, :, idx] += dk_p
            dv[:, :, idx] += dv_p
        outs.append(out_r)
        dqs.append(dq_r)
    return (unshard_sequence(outs, 2, layout), unshard_sequence(dqs, 2, layout), dk, dv), calls


@pytest.mark.parametrize("method", ["allgather", "ring", "ulysses"])
@pytest.mark.parametrize(
    "cp, load_balance, rounds", [(2, True, 1), (3, True, 1), (4, True, 1), (4, False, 1), (2, True, 2), (3, True, 2), (4, True, 2)]
)
@pytest.mark.parametrize("heads", [(4, 2, 16, 16), (2, 2, 24, 16)])  # GQA; MLA-like Dqk != Dv
def test_simulated_ranks_equal_each_document_alone(method, cp, load_balance, rounds, heads):
    """packed_rows(chunk, cp) cut into rounds: documents of 1 token, longer than a rank's share, and
    (rounds 2) of exactly two round chunks, starting at a chunk boundary."""
    H, G, dqk, dv = heads
    chunk, scale = 6, 0.37
    layout = SequenceLayout(cp, load_balance, rounds)
    positions, lengths = packed_rows(chunk, cp)
    q, k, v, dout = random_qkv(2, H, G, 2 * cp * chunk, dqk, dv, dtype=torch.float64, seed=cp)
    ref = document_reference_with_grads(q, k, v, dout, lengths, scale)
    got, calls = _simulate(method, q, k, v, dout, layout, positions, scale)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=f"{method} {name}")
    assert calls > 0


def test_attention_work_by_hand():
    # seq 8, cp 2, chunks of 2: head-tail rank 0 holds chunks 0, 3 (tokens 0-1, 6-7), rank 1 chunks 1, 2.
    # One document: query t sees t + 1 keys -> rank 0: 1+2+7+8 = 18, rank 1: 3+4+5+6 = 18.
    assert attention_work(SequenceLayout(2, True), [[8]], 8) == [18, 18]
    # Contiguous: rank 0 tokens 0-3 -> 1+2+3+4 = 10, rank 1 tokens 4-7 -> 5+6+7+8 = 26.
    assert attention_work(SequenceLayout(2, False), [[8]], 8) == [10, 26]
    # Documents [3, 5] (offsets 0 1 2 | 0 1 2 3 4): pairs per token 1 2 3 | 1 2 3 4 5.
    # head-tail: rank 0 tokens 0,1,6,7 -> 1+2+4+5 = 12; rank 1 tokens 2-5 -> 3+1+2+3 = 9.
    assert attention_work(SequenceLayout(2, True), [[3, 5]], 8) == [12, 9]
    # Per-document head-tail, 4 pieces per document: [3] -> pieces 1,1,1,0 (offsets 0 | 1 | 2 | -):
    # rank 0 pieces 0,3 -> 1, rank 1 pieces 1,2 -> 2+3; [5] -> pieces 2,1,1,1 (0-1 | 2 | 3 | 4):
    # rank 0 -> 1+2 + 5, rank 1 -> 3 + 4.
    assert attention_work(PerDocumentHeadTail(2), [[3, 5]], 8) == [1 + 8, 5 + 7]
    # rounds 2 (8 chunks of 1): rank 0 tokens 0, 3, 4, 7 -> 1+1+2+5 = 9; rank 1 tokens 1, 2, 5, 6 -> 2+3+3+4 = 12.
    assert attention_work(SequenceLayout(2, True, 2), [[8]], 8) == [18, 18]
    assert attention_work(SequenceLayout(2, True, 2), [[3, 5]], 8) == [9, 12]
    # seq 16, documents [6, 10] (pairs 1-6 | 1-10), chunks of 2: rank 0 tokens 0-1, 6-9, 14-15 ->
    # 1+2 + 1+2+3+4 + 9+10 = 32; rank 1 tokens 2-5, 10-13 -> 3+4+5+6 + 5+6+7+8 = 44. One round
    # (chunks of 4): rank 0 tokens 0-3, 12-15 -> 10 + 7+8+9+10 = 44; rank 1 -> 5+6 + 21 = 32.
    assert attention_work(SequenceLayout(2, True, 2), [[6, 10]], 16) == [32, 44]
    assert attention_work(SequenceLayout(2, True), [[6, 10]], 16) == [44, 32]
    # Contiguous ignores rounds in effect: the same tokens per rank.
    assert attention_work(SequenceLayout(2, False, 2), [[6, 10]], 16) == attention_work(SequenceLayout(2, False), [[6, 10]], 16)
    with pytest.raises(ValueError, match=r"not divisible by 2 x cp x rounds = 8"):
        attention_work(SequenceLayout(2, True, 2), [[6]], 6)
    # Two rows add up; imbalance is max / mean.
    assert attention_work(SequenceLayout(2, True), [[8], [3, 5]], 8) == [30, 27]
    assert imbalance([30, 27]) == pytest.approx(30 / 28.5)
    with pytest.raises(ValueError, match="sum to 7"):
        attention_work(SequenceLayout(2, True), [[3, 4]], 8)


def test_token_offset_slices_reach_the_kernels_aligned():
    """Document calls slice at token offsets: a slice whose pointer is not 16-byte aligned (bf16 with
    head dim 20: 40 bytes a token) is copied densely; an aligned one is passed as it is."""
    from plait.contextparallel.kernels import aligned

    k = torch.randn(1, 2, 10, 20).to(torch.bfloat16)
    odd = k[:, :, 1:4]
    assert odd.data_ptr() % 16 and aligned(odd).data_ptr() % 16 == 0 and torch.equal(aligned(odd), odd)
    assert aligned(k[:, :, 2:4]).data_ptr() == k[:, :, 2:4].data_ptr()


def test_document_positions_must_be_the_full_rows():
    """Shards' positions (or another batch) instead of the full rows fail before any collective."""
    from plait.contextparallel import ContextParallelAttention

    attention = ContextParallelAttention(None, "ring", SequenceLayout(2), scale=0.2)  # no mesh reached
    q = torch.randn(2, 4, 8, 16)  # this rank's 8 of 16 tokens
    shard_positions = torch.stack([positions_from_lengths([3, 5])] * 2)
    with pytest.raises(ValueError, match=r"document_positions \[2, 8\] must be the full rows \[2, 16\]"):
        attention(q, q[:, :2], q[:, :2], shard_positions)
