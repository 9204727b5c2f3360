"""Document masking: the segments of packed rows, read from their document positions.

A packed row holds several documents. `document_positions_BS` (int32 [B, S]) is each token's
offset inside its document: 0 at a document's first token; a row that starts inside a document
continues its offset. A row's segments are the runs cut at every 0 and at the row start; under
the "document" mask a query sees only the earlier keys of its own segment (block-diagonal causal).

Attention computes that exactly without an S x S mask: one causal kernel call per segment, so
the fully masked blocks are never computed. The segments are read on the host once per tensor
(cached on it for every layer, the backward and activation-checkpoint recomputes): free on CPU,
the one host sync of document masking on CUDA.
"""

import torch

ATTENTION_MASKS = ("causal", "document")
ROPE_POSITIONS = ("sequence", "document")

_CACHE_ATTR = "_plait_document_segments"


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


def to_device_with_segments(document_positions_BS: torch.Tensor, device) -> torch.Tensor:
    """The tensor on `device`, carrying the segments read from it on the host: read them while the
    tensor is still on the CPU (row_segments) and the step never reads them back from the device."""
    moved = document_positions_BS.to(device, non_blocking=True)
    if moved is not document_positions_BS:
        setattr(moved, _CACHE_ATTR, row_segments(document_positions_BS))
    return moved


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
