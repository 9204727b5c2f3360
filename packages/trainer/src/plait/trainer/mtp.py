"""Multi-token prediction in the step (model.mtp_layers): each depth's inputs, targets and loss.

Depth k (1..K) at position i reads the token at i + k and predicts the one at i + k + 1, which is
labels[i + k]. Both come from the whole row, shifted before context parallel splits it, so a
rank's shard needs nothing from its neighbours: the shifted rows are split with the same layout
as the row itself. The last k positions of a row have no target (ignored). Under document
masking a target also counts only when the token depth k reads is in position i's document
(document position p_{i+k} = p_i + k): the prediction then never crosses a document's end, and
the document's last token predicts what the main loss predicts there.

The loss is main + mtp_loss_scale x (the mean over depths of each depth's loss), each loss the
sum over its valid targets divided by the global count of them (data parallel averages the rest).
"""

import torch

IGNORE_INDEX = -100


def mtp_depths(model_args) -> int:
    return getattr(model_args, "mtp_layers", 0)


def shifted_rows(
    inputs_BS: torch.Tensor, labels_BS: torch.Tensor, depths: int, document_positions_BS: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_KBS, labels_KBS): depth k's input tokens (the row shifted left by k; the last k
    positions wrap around, their targets ignored) and targets, for k = 1..depths."""
    S = inputs_BS.shape[1]
    tokens, labels = [], []
    for k in range(1, depths + 1):
        tokens.append(inputs_BS.roll(-k, dims=1))
        target_BS = torch.cat([labels_BS[:, k:], labels_BS.new_full((labels_BS.shape[0], min(k, S)), IGNORE_INDEX)], 1)
        if document_positions_BS is not None and k < S:
            p = document_positions_BS.to(labels_BS.device)
            other_document = torch.cat([p[:, k:] != p[:, :-k] + k, torch.ones_like(p[:, :k], dtype=torch.bool)], 1)
            target_BS = target_BS.masked_fill(other_document, IGNORE_INDEX)
        labels.append(target_BS[:, :S])
    return torch.stack(tokens), torch.stack(labels)


def depth_losses(loss_fn, depth_logits: list, labels_KBS: torch.Tensor, scales_K: torch.Tensor) -> list:
    """Each depth's summed token loss times its scale (ranks / its global count of targets)."""
    return [loss_fn(logits_BSV, labels_KBS[k]) * scales_K[k] for k, logits_BSV in enumerate(depth_logits)]
