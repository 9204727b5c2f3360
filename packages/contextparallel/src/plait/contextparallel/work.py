"""Attention work per cp rank under document masking: what each sharding strategy leaves to balance.

Work is query-key pairs actually computed (FLOPs-proportional): a full block Lq * Lk, a causal
square L (L + 1) / 2. All methods but Ulysses compute a query's pairs on the rank holding the query,
so a rank's work is its queries'; Ulysses computes the whole sequence on heads / cp per rank and is
balanced whatever the documents (its work is total / cp on every rank).

    attention_work(SequenceLayout(cp, load_balance=True, rounds=1), [[300, 700, ...], ...], seq_len)
    attention_work(PerDocumentHeadTail(cp), segments_per_row, seq_len)
    imbalance(work)  # max / mean

- `SequenceLayout(cp, True, rounds)`: our head-tail chunks (rank r holds chunks r and 2cp-1-r of
  each round of 2cp chunks, 2 x cp x rounds chunks a row), counted from the very document plans the
  kernels run (`documents.plan_document_blocks`); more rounds spread short documents' work finer;
- `SequenceLayout(cp, False)`: contiguous chunks;
- `PerDocumentHeadTail(cp)`: torchtitan's per-document head-tail strategy, simulated (not a runtime
  layout here): every document segment is cut into 2 x cp near-equal pieces, rank r takes pieces r
  and 2cp-1-r of each. It balances work per document at the price of uneven token counts and
  sequence-dependent shards.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from .documents import boundaries_from_lengths, plan_document_blocks, work
from .layout import SequenceLayout


@dataclass(frozen=True)
class PerDocumentHeadTail:
    """torchtitan's per-document head-tail load balancing over `cp` ranks (simulated)."""

    cp: int


def attention_work(
    layout: SequenceLayout | PerDocumentHeadTail, segments_per_row: Sequence[Sequence[int]], seq_len: int
) -> list[int]:
    """Query-key pairs each cp rank computes for rows with these segment lengths (each row's lengths
    in order, summing to seq_len; a row starting mid-document starts with that document's tail),
    summed over the rows (a micro-batch). seq_len must divide into the layout's chunks."""
    boundaries = [boundaries_from_lengths(lengths) for lengths in segments_per_row]
    for lengths, b in zip(segments_per_row, boundaries):
        if b[-1] != seq_len:
            raise ValueError(f"segment lengths {list(lengths)} sum to {b[-1]}, not seq_len {seq_len}")
    if isinstance(layout, PerDocumentHeadTail):
        return _per_document(layout.cp, segments_per_row)
    chunk = layout.chunk_len(seq_len)
    return [
        work(plan_document_blocks(layout.chunks(rank), range(layout.n_chunks), chunk, boundaries), len(boundaries))
        for rank in range(layout.cp)
    ]


def _per_document(cp: int, segments_per_row: Sequence[Sequence[int]]) -> list[int]:
    n = 2 * cp
    ranks = [0] * cp
    for lengths in segments_per_row:
        for length in lengths:
            start = 0
            for piece in range(n):
                size = length // n + (piece < length % n)
                # queries at document offsets [start, start + size) see offset + 1 keys each
                pairs = (start + 1 + start + size) * size // 2
                ranks[piece if piece < cp else n - 1 - piece] += pairs
                start += size
    return ranks


def imbalance(work_per_rank: Sequence[int]) -> float:
    """max / mean: the slowest rank's work over the average (1.0 = balanced)."""
    mean = sum(work_per_rank) / len(work_per_rank)
    return max(work_per_rank) / mean if mean else 1.0
