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

from .config import ConfigError

IGNORE_INDEX = -100


def mtp_depths(model_args) -> int:
    return getattr(model_args, "mtp_layers", 0)


def check_mtp_stages(config, dims, model_args) -> None:
    """Under pipeline parallel the MTP depths (the last blocks) belong on the last stage, with the
    output head they share."""
    depths = getattr(model_args, "mtp_layers", 0)
    counts = list(config.parallelism.layers_per_stage)
    if not depths or dims.pp == 1 or not counts or counts[-1] >= depths:
        return
    raise ConfigError(f"parallelism.layers_per_stage = {','.join(map(str, counts))} puts model.mtp_layers = {depths} "
                      f"multi-token-prediction depths (the last {depths} blocks: {model_args.n_layers} + {depths} "
                      f"in all) before the last stage: give the last stage at least {depths}.")


def check_mtp_seq_len(config, model_args) -> None:
    """Depth k has seq_len - k targets in a row: a depth of seq_len or deeper has none, and its loss
    (0) would still count in the mean over depths, silently weakening the term."""
    depths, seq_len = getattr(model_args, "mtp_layers", 0), config.training.seq_len
    if depths >= seq_len > 0:
        raise ConfigError(f"model.mtp_layers = {depths} needs training.seq_len > {depths}: depth k predicts k + 1 "
                          f"tokens ahead, and in rows of {seq_len} tokens depth {seq_len} and deeper have no target "
                          "(their zero loss would count in the mean): lower model.mtp_layers or raise training.seq_len.")


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


def objective(losses: list, mtp_loss_scale: float):
    """What the step optimises from [main, depth 1, ..., depth K] (each already scaled): main +
    mtp_loss_scale x the depths' mean."""
    return losses[0] + sum(losses[1:]) * (mtp_loss_scale / (len(losses) - 1)) if len(losses) > 1 else losses[0]


class PipelineMTPLoss:
    """The last pipeline stage's loss under MTP: the model's (logits, depth 1, ..., depth K) against
    targets [B, (1 + K) x S] (the main labels, then each depth's, side by side: the schedule splits
    targets on the batch dim only). `scales` [1 + K] are set before each step (ranks / each loss's
    global count); `parts` sums each loss over the step's micro-batches, for the log. Outputs that
    are one tensor (validation: no shifted rows) take `loss_fn` as they are."""

    def __init__(self, loss_fn, depths: int, mtp_loss_scale: float):
        self.loss_fn, self.depths, self.mtp_loss_scale = loss_fn, depths, mtp_loss_scale
        self.scales: torch.Tensor | None = None
        self.parts: list = []

    def start_step(self, scales_K: torch.Tensor) -> None:
        self.scales, self.parts = scales_K, []

    def __call__(self, output, target_BX: torch.Tensor) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return self.loss_fn(output, target_BX)
        logits_BSV, *depth_logits = output
        labels_BKS = target_BX.unflatten(1, (1 + self.depths, -1))
        losses = [self.loss_fn(logits_BSV, labels_BKS[:, 0]) * self.scales[0]]
        losses += depth_losses(self.loss_fn, depth_logits, labels_BKS[:, 1:].transpose(0, 1), self.scales[1:])
        self.parts.append([loss.detach() for loss in losses])
        return objective(losses, self.mtp_loss_scale)
