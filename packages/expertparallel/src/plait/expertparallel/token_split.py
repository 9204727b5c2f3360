"""Deduplicated dispatch under tensor parallel (etp = 1).

Inside the MoE's tensor-parallel region every TP rank holds the same routed rows (the block's
input is gathered there, and the router runs on it). Sending them all from every TP rank would
move each token tp times. Instead TP rank r dispatches only its contiguous share of the rows,
which are sorted by expert, so its per-expert counts follow from the global ones on the device
(no host sync). After combine the share is padded back with zeros to the full rows: the output is
then a partial sum over the TP ranks, which the region's exit reduces (reduce-scatter under
sequence parallel) exactly as it reduces the shared experts' partial outputs. The backward
mirrors it: each TP rank sends back gradients only for its own rows, and the zeros elsewhere are a
partial gradient the region's entry sums.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RowShare:
    start: int
    stop: int
    total: int


def row_share(num_rows: int, rank: int, parts: int) -> RowShare:
    """Rank `rank`'s contiguous share of `num_rows` rows split into `parts` (sizes differ by <= 1)."""
    return RowShare(rank * num_rows // parts, (rank + 1) * num_rows // parts, num_rows)


def counts_in_share(num_tokens_per_expert_E: torch.Tensor, share: RowShare) -> torch.Tensor:
    """Per-expert counts of the rows [start, stop) of expert-sorted rows, computed on the device."""
    ends_E = torch.cumsum(num_tokens_per_expert_E, 0)
    starts_E = ends_E - num_tokens_per_expert_E
    return ends_E.clamp(share.start, share.stop) - starts_E.clamp(share.start, share.stop)


def take_share(x_ND: torch.Tensor, share: RowShare) -> torch.Tensor:
    return x_ND[share.start : share.stop]


def restore_share(y_share_ND: torch.Tensor, share: RowShare) -> torch.Tensor:
    """The share's rows in place, zeros for the rows other TP ranks computed."""
    return F.pad(y_share_ND, (0, 0, share.start, share.total - share.stop))
