"""Document masking under context parallel: the segments of packed rows, and the kernel calls they leave.

`document_positions_BS` [B, S] (int32, the full row, the same on every cp rank) holds each token's
offset inside its document; a row's segments are the runs cut where it is 0 and at the row start.
Query i sees key j iff j <= i and both lie in one segment (docs/contracts.md, issue 22).

A document plan is the causal plan (`layout.plan_blocks`) refined row by row, in token units:
- a full block (every key before every query): at most one segment meets both sides -- the one
  holding the last key and the first query, as segments are intervals -- so at most one call;
- a causal square: one causal square per segment it meets.
Local buffers hold their chunks in ascending sequence order (every layout does), so a segment's
tokens are one contiguous local range on each side and the top-left causal mask stays right.
Rows whose calls coincide share them (a batch range): rows holding one document each cost exactly
the causal plan, and the attention module then takes the causal path itself.
"""

import bisect
from collections.abc import Sequence

import torch

from plait.mesh.declared_sync import declared_sync

from .layout import Block, plan_blocks

_CACHE_ATTR = "_plait_cp_document_segments"
# Where a caller that read the rows' boundaries on the host already (the trainer, from the loader's
# CPU tensor; plait.models.documents) leaves them on the tensor, as plain data ((0, ..., S) per
# row): then nothing is read back from the device at all (docs/contracts.md).
HOST_BOUNDARIES_ATTR = "_plait_document_segments"

Boundaries = tuple[int, ...]  # one row: (0, s1, ..., S), every segment [b[i], b[i + 1])


class DocumentSegments:
    """The segments of every row of a micro-batch, read once, with the plans built from them."""

    def __init__(self, boundaries: Sequence[Boundaries], seq_len: int):
        self.boundaries = tuple(tuple(b) for b in boundaries)
        self.seq_len = seq_len
        self._plans: dict = {}

    @property
    def batch(self) -> int:
        return len(self.boundaries)

    @property
    def single_document_rows(self) -> bool:
        """Every row is one segment: document masking is causal masking."""
        return all(len(b) == 2 for b in self.boundaries)

    def plan(self, q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk: int) -> list[Block]:
        """`plan_document_blocks` for these rows, built once per (buffers, chunk) and kept: every
        layer and the backward (activation checkpointing's recompute too) reuse it."""
        key = (tuple(q_chunks), tuple(kv_chunks), chunk)
        if key not in self._plans:
            self._plans[key] = plan_document_blocks(q_chunks, kv_chunks, chunk, self.boundaries)
        return self._plans[key]

    def __repr__(self) -> str:
        return f"DocumentSegments(batch={self.batch}, seq_len={self.seq_len}, segments={[len(b) - 1 for b in self.boundaries]})"


def boundaries_from_lengths(lengths: Sequence[int]) -> Boundaries:
    """A row's segment lengths, in order -> its boundaries (0, ..., S)."""
    out = [0]
    for n in lengths:
        if n < 1:
            raise ValueError(f"segment lengths must be >= 1, got {list(lengths)}")
        out.append(out[-1] + n)
    return tuple(out)


def document_segments(document_positions_BS: torch.Tensor) -> DocumentSegments:
    """The rows' segments, read on the host once per tensor and cached on it (keyed by its version,
    so a buffer refilled in place is read again). On CUDA this read is document masking's one
    declared host sync per micro-batch; pass the same tensor object to every layer."""
    version = _version(document_positions_BS)
    cached = getattr(document_positions_BS, _CACHE_ATTR, None)
    if cached is not None and cached[0] == version:
        return cached[1]
    if document_positions_BS.dim() != 2:
        raise ValueError(f"document_positions must be [B, S], got shape {tuple(document_positions_BS.shape)}")
    B, S = document_positions_BS.shape
    known = getattr(document_positions_BS, HOST_BOUNDARIES_ATTR, None)
    if known is not None:  # read on the host before the step: nothing comes back from the device
        segments = DocumentSegments(known, S)
    else:
        with declared_sync("document masking: the rows' segments, read once per micro-batch"):
            # One copy to the host (the sync on CUDA); the rest runs on host memory.
            starts = torch.nonzero(document_positions_BS.cpu()[:, 1:] == 0).tolist()
        rows: list[list[int]] = [[0] for _ in range(B)]
        for b, i in starts:
            rows[b].append(i + 1)
        segments = DocumentSegments([(*r, S) for r in rows], S)
    setattr(document_positions_BS, _CACHE_ATTR, (version, segments))
    return segments


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def plan_document_blocks(
    q_chunks: Sequence[int], kv_chunks: Sequence[int], chunk: int, boundaries_B: Sequence[Boundaries]
) -> list[Block]:
    """The kernel calls (token units, batch ranges) computing document attention of the local query
    chunks against the local key chunks (global chunk indices, ascending, `chunk` tokens each).
    Fully masked blocks never appear; consecutive rows with the same calls share them."""
    q_chunks, kv_chunks = list(q_chunks), list(kv_chunks)
    for name, chunks in (("query", q_chunks), ("key", kv_chunks)):
        if any(a >= b for a, b in zip(chunks, chunks[1:])):
            raise ValueError(f"{name} chunks {chunks} are not ascending: a segment would not be one local range")
    causal = plan_blocks(q_chunks, kv_chunks)
    runs: dict[tuple, list[list[int]]] = {}  # call geometry -> row runs [b0, b1)
    per_row: dict[Boundaries, list[tuple]] = {}
    for row, bounds in enumerate(boundaries_B):
        if bounds not in per_row:
            per_row[bounds] = [g for blk in causal for g in _refine(blk, q_chunks, kv_chunks, chunk, bounds)]
        for geometry in per_row[bounds]:
            rows = runs.setdefault(geometry, [])
            if rows and rows[-1][1] == row:
                rows[-1][1] = row + 1
            else:
                rows.append([row, row + 1])
    return [Block(*geometry, b0=b0, b1=b1) for geometry, rows in runs.items() for b0, b1 in rows]


def _refine(blk: Block, q_chunks, kv_chunks, chunk: int, bounds: Boundaries) -> list[tuple]:
    """One causal-plan block (chunk slots) -> the (q0, q1, k0, k1, causal) token calls of one row."""
    q_slots, kv_slots = range(blk.q0, blk.q1), range(blk.k0, blk.k1)
    if blk.causal:  # the same chunks on both sides: one causal square per segment met
        first = q_chunks[blk.q0] * chunk
        last = (q_chunks[blk.q1 - 1] + 1) * chunk
        calls = []
        i = bisect.bisect_right(bounds, first) - 1
        while i < len(bounds) - 1 and bounds[i] < last:
            q = _local(bounds[i], bounds[i + 1], q_chunks, q_slots, chunk)
            k = _local(bounds[i], bounds[i + 1], kv_chunks, kv_slots, chunk)
            if q is not None:
                calls.append((*q, *k, True))
            i += 1
        return calls
    # Full block: every key precedes every query; only the segment holding the last key can reach a query.
    last_key = (kv_chunks[blk.k1 - 1] + 1) * chunk - 1
    i = bisect.bisect_right(bounds, last_key) - 1
    start, end = bounds[i], bounds[i + 1]
    if end <= q_chunks[blk.q0] * chunk:
        return []  # fully masked: never computed
    q = _local(start, end, q_chunks, q_slots, chunk)
    k = _local(start, end, kv_chunks, kv_slots, chunk)
    return [(*q, *k, False)]


def _local(start: int, end: int, chunks, slots: range, chunk: int) -> tuple[int, int] | None:
    """The local token range [lo, hi) of the tokens in slots `slots` whose sequence positions lie in
    [start, end); contiguous because the slots hold ascending chunks. None when empty."""
    lo = hi = None
    for s in slots:
        c0 = chunks[s] * chunk
        a, b = max(start, c0), min(end, c0 + chunk)
        if a < b:
            if lo is None:
                lo = s * chunk + a - c0
            hi = s * chunk + b - c0
    return None if lo is None else (lo, hi)


def work(blocks: Sequence[Block], batch: int) -> int:
    """Query-key pairs the kernels compute for `blocks` (token units): a full block Lq * Lk, a causal
    square L (L + 1) / 2, times its rows (FLOPs-proportional)."""
    total = 0
    for b in blocks:
        lq, lk = b.q1 - b.q0, b.k1 - b.k0
        rows = (b.b1 if b.b1 is not None else batch) - b.b0
        total += rows * (lq * (lq + 1) // 2 if b.causal else lq * lk)
    return total
