"""Document masking: the segments of packed rows, read from their document positions.

A packed row holds several documents. `document_positions_BS` (int32 [B, S]) is each token's
offset inside its document: 0 at a document's first token; a row that starts inside a document
continues its offset. A row's segments are the runs cut at every 0 and at the row start; under
the "document" mask a query sees only the earlier keys of its own segment (block-diagonal causal).

Attention computes that exactly without an S x S mask, in one op per layer
(plait.models.document_attention) over the rows folded into T = B x S tokens, given the
documents' offsets in that fold (`document_offsets`: int32, a fixed shape). The segments are read
on the host once per tensor (cached on it for every layer, the backward and activation-checkpoint
recomputes), and the offsets built from them there: the trainer does both on the loader's CPU
tensor before the step (`to_device_with_segments`), so the step reads nothing back from the device.
"""

import torch

# A model's `attention_mask`: "document", a packed row's documents never attend to each other
# (block-diagonal causal; the forward then takes document_positions); "causal": plain causal.
ATTENTION_MASKS = ("causal", "document")
# A model's `rope_positions`: "document", RoPE positions restart at every document (they are the
# document positions); "sequence": 0..S-1 along the row.
ROPE_POSITIONS = ("sequence", "document")

_CACHE_ATTR = "_plait_document_segments"
_OFFSETS_ATTR = "_plait_document_offsets"
# Room for this many documents per row at least; more grow it to the next power of two. FA2's
# varlen kernels launch blocks (and its backward allocates 128 rows of fp32 scratch) per document
# slot, so room for every possible document (S / 2 of them at seq 8192) would cost more than the
# attention: a small fixed capacity that grows rarely keeps the shape static and the waste nil.
MIN_DOCUMENTS_PER_ROW = 16


def row_segments(document_positions_BS: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Per row, the start of every segment and then the row length: ((0, s1, ..., S), ...)."""
    cached = getattr(document_positions_BS, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    B, S = document_positions_BS.shape
    # One host read for the whole batch; index 0 starts a segment whatever its position.
    starts_N2 = (document_positions_BS[:, 1:] == 0).cpu().nonzero().tolist()
    rows: list[list[int]] = [[0] for _ in range(B)]
    for b, s in starts_N2:
        rows[b].append(s + 1)
    segments = tuple((*row, S) for row in rows)
    setattr(document_positions_BS, _CACHE_ATTR, segments)
    return segments


def documents_capacity(segments, at_least: int = MIN_DOCUMENTS_PER_ROW) -> int:
    """Documents per row the offsets have room for: `at_least`, doubled until the row with the
    most segments fits. A caller that keeps the largest capacity it has seen (the trainer) keeps
    the offsets' shape fixed over a run, growing a handful of times at most."""
    most = max((len(bounds) - 1 for bounds in segments), default=1)
    capacity = max(1, at_least)
    while capacity < most:
        capacity *= 2
    return capacity


def document_offsets(segments, seq_len: int, capacity: int | None = None) -> torch.Tensor:
    """The documents' starts in the rows folded into B x S tokens, then B x S, padded at the end
    with B x S to B x capacity + 1 entries (int32, on the host). What document attention's
    kernels take as `cu_seqlens`; the padding's documents are empty."""
    capacity = documents_capacity(segments) if capacity is None else capacity
    offsets = [0]
    for row, bounds in enumerate(segments):
        if len(bounds) - 1 > capacity:
            raise ValueError(f"row {row} holds {len(bounds) - 1} documents, the offsets have room for {capacity}")
        offsets.extend(row * seq_len + end for end in bounds[1:])
    total = len(segments) * seq_len
    offsets.extend([total] * (len(segments) * capacity + 1 - len(offsets)))
    return torch.tensor(offsets, dtype=torch.int32)


def offsets_of(document_positions_BS: torch.Tensor) -> torch.Tensor:
    """The offsets (`document_offsets`) of these rows on their device: the ones the trainer built
    on the host and moved with the tensor, else built now from the host segments (row_segments)
    and cached on it. Call it outside compiled code (the model's forward does, once per step)."""
    cached = getattr(document_positions_BS, _OFFSETS_ATTR, None)
    if cached is not None:
        return cached
    _, S = document_positions_BS.shape
    offsets = document_offsets(row_segments(document_positions_BS), S).to(
        document_positions_BS.device, non_blocking=True
    )
    setattr(document_positions_BS, _OFFSETS_ATTR, offsets)
    return offsets


def to_device_with_segments(document_positions_BS: torch.Tensor, device, capacity: int | None = None) -> torch.Tensor:
    """The tensor on `device`, carrying the segments read from it on the host and the offsets
    built from them there (with room for `capacity` documents per row; default: the fewest
    powers of two that fit): read while the tensor is still on the CPU, so the step never reads
    them back from the device, and the offsets' copy is queued with the tensor's."""
    segments = row_segments(document_positions_BS)
    offsets = document_offsets(segments, document_positions_BS.shape[1], capacity)
    moved = document_positions_BS.to(device, non_blocking=True)
    setattr(moved, _CACHE_ATTR, segments)
    setattr(moved, _OFFSETS_ATTR, offsets.to(device, non_blocking=True))
    return moved


def check_masks(attention_mask: str, rope_positions: str) -> None:
    """A model's args name a known attention mask and RoPE positions (every model's __post_init__)."""
    if attention_mask not in ATTENTION_MASKS:
        raise ValueError(f"attention_mask {attention_mask!r}: use one of {', '.join(ATTENTION_MASKS)}")
    if rope_positions not in ROPE_POSITIONS:
        raise ValueError(f"rope_positions {rope_positions!r}: use one of {', '.join(ROPE_POSITIONS)}")


def check_document_positions(document_positions_BS: torch.Tensor, batch: int, seq_len: int) -> None:
    if document_positions_BS.shape != (batch, seq_len):
        raise ValueError(
            f"document_positions has shape {tuple(document_positions_BS.shape)}, the tokens are "
            f"[{batch}, {seq_len}]: pass one position per token of the full (unsharded) rows"
        )


def attention_inputs(
    attention_mask: str, rope_positions: str, tokens_BS: torch.Tensor, positions, document_positions_BS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RoPE positions, document positions for attention or None) of a forward call.

    Explicit `positions` win (context parallel passes its shard's); else per-document positions
    under rope_positions = "document", else arange(S).
    """
    needs_documents = attention_mask == "document" or (positions is None and rope_positions == "document")
    if needs_documents and document_positions_BS is None:
        raise ValueError(
            f"attention_mask = {attention_mask!r}, rope_positions = {rope_positions!r} need the batch's "
            "document_positions: pass model(tokens, positions, document_positions) (the packed loader emits them)"
        )
    if positions is None:
        if rope_positions == "document":
            positions = document_positions_BS
        else:
            positions = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
    return positions, document_positions_BS if attention_mask == "document" else None
