"""Which tokens of a sequence each cp rank holds, and which attention blocks that leaves to compute.

The sequence is cut into 2 x cp x rounds equal chunks; round j is chunks [2cp j, 2cp (j + 1)), and
rank r holds 2 x rounds of them, always in ascending order (the plans rely on it):

    load-balanced (head-tail, "zigzag"):  chunks r and 2cp-1-r of every round -- every rank gets
                                          the same causal work, for any rounds
    contiguous:                           chunks [2 rounds r, 2 rounds (r + 1))  -- rank cp-1 does
                                          ~2cp-1 times the work of rank 0 (rounds changes nothing)

rounds = 1 is the classic head-tail layout (chunks r and 2cp-1-r of 2cp). More rounds cut the
sequence finer, which is what balances document-masked work when documents are short relative to
seq / cp (a document's work lands on few chunks; finer chunks spread it), at the price of more,
smaller kernel calls.

Under causal attention a query chunk a sees key chunk b fully when b < a, its own chunk through a
square causal mask, and nothing when b > a. `plan_blocks` turns that rule into the few kernel
calls a (query chunks, key chunks) pair needs; blocks that are fully masked never appear.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """The chunk assignment for `cp` ranks; `load_balance` picks head-tail over contiguous, `rounds`
    how many head-tail rounds the sequence is cut into (2 x cp x rounds chunks)."""

    cp: int
    load_balance: bool = True
    rounds: int = 1

    def __post_init__(self):
        if self.cp < 1 or self.rounds < 1:
            raise ValueError(f"SequenceLayout needs cp >= 1 and rounds >= 1, got cp={self.cp}, rounds={self.rounds}")

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp * self.rounds

    @property
    def chunks_per_rank(self) -> int:
        """Chunks every rank holds (2 x rounds): a local buffer of L tokens is this many chunks of L / it."""
        return 2 * self.rounds

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices rank `rank` holds, in the order it holds them (ascending)."""
        if self.load_balance:
            n = 2 * self.cp
            return tuple(c for j in range(self.rounds) for c in (n * j + rank, n * j + n - 1 - rank))
        per = self.chunks_per_rank
        return tuple(range(per * rank, per * (rank + 1)))

    def rank_order(self) -> list[int]:
        """Global chunk index of every (rank, slot), rank-major: the order of a gather over ranks."""
        return [c for rank in range(self.cp) for c in self.chunks(rank)]

    def natural_order(self) -> list[int]:
        """Position in rank_order() of every chunk, in sequence order."""
        rank_order = self.rank_order()
        return [rank_order.index(c) for c in range(self.n_chunks)]

    def rank_order_index(self, device=None) -> torch.Tensor:
        """rank_order() as a tensor on `device`: puts sequence-ordered chunks into rank-major order."""
        return _order_indices(self.cp, self.load_balance, self.rounds, torch.device(device or "cpu"))[0]

    def natural_order_index(self, device=None) -> torch.Tensor:
        """natural_order() as a tensor on `device`: puts rank-major chunks back into sequence order."""
        return _order_indices(self.cp, self.load_balance, self.rounds, torch.device(device or "cpu"))[1]

    def local_indices(self, rank: int, seq_len: int, device=None) -> torch.Tensor:
        """Positions (int64) in the full sequence of the tokens rank `rank` holds, in its order."""
        chunk = self.chunk_len(seq_len)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunks(rank)])

    def chunk_len(self, seq_len: int) -> int:
        if seq_len % self.n_chunks:
            raise ValueError(f"sequence length {seq_len} is not divisible by {self._cut()}")
        return seq_len // self.n_chunks

    def _cut(self) -> str:
        return f"2 x cp = {self.n_chunks}" if self.rounds == 1 else f"2 x cp x rounds = {self.n_chunks}"


@functools.cache
def _order_indices(cp: int, load_balance: bool, rounds: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank order, natural order) index tensors, built once per layout and device, and on the device
    itself: torch.tensor(list, device="cuda") would be a blocking host-to-device copy, and every
    layer's attention asks for them each micro-batch. Read-only: never written."""
    with torch.inference_mode(False):  # normal tensors even if first asked for under inference mode
        n, per = 2 * cp, 2 * rounds
        c = torch.arange(n * rounds, device=device)
        if not load_balance:
            return c, c
        # Rank-major slot s = per r + 2 j + w holds round j's chunk r (w = 0) or 2cp-1-r (w = 1).
        r, j, w = c // per, (c % per) // 2, c % 2
        rank_order = n * j + torch.where(w == 0, r, n - 1 - r)
        # Chunk c = 2cp j + i sits with rank min(i, 2cp-1-i), in its slot 2 j + (i >= cp).
        j, i = c // n, c % n
        natural_order = per * torch.where(i < cp, i, n - 1 - i) + 2 * j + (i >= cp).long()
        return rank_order, natural_order


def shard_sequence(x: torch.Tensor, dim: int, rank: int, layout: SequenceLayout) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (the full sequence), in the layout's order."""
    if x.shape[dim] % layout.n_chunks:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by {layout._cut()}")
    chunks = x.chunk(layout.n_chunks, dim=dim)
    return torch.cat([chunks[c] for c in layout.chunks(rank)], dim=dim)


def shard_batch(
    tokens_BS: torch.Tensor, labels_BS: torch.Tensor, rank: int, layout: SequenceLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's (tokens, labels, positions) of a [B, S] batch, in the layout's order.

    Labels are sharded exactly like the tokens they follow, so every token is counted on exactly
    one rank; positions [S / cp] (int64) are where those tokens sit in the sequence (RoPE indexes by them).
    """
    positions_S = layout.local_indices(rank, tokens_BS.shape[1], device=tokens_BS.device)
    return shard_sequence(tokens_BS, 1, rank, layout), shard_sequence(labels_BS, 1, rank, layout), positions_S


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int, layout: SequenceLayout) -> torch.Tensor:
    """Inverse of `shard_sequence` given every rank's shard (rank order): the full sequence."""
    pieces = {}
    for rank, shard in enumerate(shards):
        for slot, chunk in zip(layout.chunks(rank), shard.chunk(layout.chunks_per_rank, dim=dim)):
            pieces[slot] = chunk
    return torch.cat([pieces[c] for c in range(layout.n_chunks)], dim=dim)


@dataclass(frozen=True)
class Block:
    """One kernel call: batch rows [b0, b1) (all rows when b1 is None), query units [q0, q1) against
    key units [k0, k1). A unit is one chunk in the causal plans (`plan_blocks`), one token in the
    document plans (`documents.plan_document_blocks`): the caller passes its size to the kernels."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool  # square diagonal block (q1 - q0 == k1 - k0), causal mask top-left aligned
    b0: int = 0
    b1: int | None = None

    @property
    def batch(self) -> slice:
        return slice(self.b0, self.b1)


def plan_blocks(q_chunks: Sequence[int], kv_chunks: Sequence[int]) -> list[Block]:
    """The kernel calls that compute causal attention of query chunks against key chunks.

    `q_chunks` and `kv_chunks` are global chunk indices in the order the local buffers hold them.
    Masked blocks are skipped; neighbouring calls are coalesced when their keys (or queries) are
    adjacent in the buffer, so e.g. a rank's own ascending chunks need one causal call.
    """
    q_chunks, kv_chunks = list(q_chunks), list(kv_chunks)
    if q_chunks == kv_chunks and all(a < b for a, b in zip(q_chunks, q_chunks[1:])):
        # Ascending and equal: a causal mask over local slots masks exactly the later chunks.
        return [Block(0, len(q_chunks), 0, len(kv_chunks), True)]
    kv_slot = {c: j for j, c in enumerate(kv_chunks)}
    diagonal, full = [], []
    covered: set[tuple[int, int]] = set()  # (q slot, kv slot) pairs a causal block already computes
    # Runs of consecutive chunks held consecutively on both sides become one square causal block.
    i = 0
    while i < len(q_chunks):
        if q_chunks[i] not in kv_slot:
            i += 1
            continue
        j = kv_slot[q_chunks[i]]
        n = 1
        while (
            i + n < len(q_chunks)
            and j + n < len(kv_chunks)
            and q_chunks[i + n] == q_chunks[i] + n
            and kv_chunks[j + n] == q_chunks[i] + n
        ):
            n += 1
        diagonal.append(Block(i, i + n, j, j + n, True))
        covered.update((i + a, j + b) for a in range(n) for b in range(n))
        i += n
    for i, a in enumerate(q_chunks):
        visible = [j for j, b in enumerate(kv_chunks) if b < a and (i, j) not in covered]
        for k0, k1 in _runs(visible):
            full.append(Block(i, i + 1, k0, k1, False))
    return diagonal + _coalesce_queries(full)


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def _coalesce_queries(blocks: list[Block]) -> list[Block]:
    merged: list[Block] = []
    for b in blocks:
        for n, m in enumerate(merged):
            if (m.k0, m.k1) == (b.k0, b.k1) and m.q1 == b.q0:
                merged[n] = Block(m.q0, b.q1, b.k0, b.k1, False)
                break
        else:
            merged.append(b)
    return merged
