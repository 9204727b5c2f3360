"""What the trainer calls on a whole model: the per-step bias update and the optional aux loss.

Trainer use (one optimizer step of N micro-batches):

    for micro_batch in step:
        logits = model(tokens)
        loss = (cross_entropy(logits, labels) + moe_aux_loss(model)) / N   # aux loss is opt-in
        loss.backward()
    optimizer.step()
    update_moe_load_balance(model, coeff=1e-3, reduce_counts=all_reduce_over_dp_cp)

(or register `update_moe_load_balance` as an optimizer step pre-hook). The routers count tokens
in every forward; the update reads the counts of the whole step, so the result is the same for
one big batch or many micro-batches. Under data parallel each rank sees different tokens, so
pass `reduce_counts` (an in-place SUM all-reduce over the dp x cp ranks) to keep the bias
identical everywhere; the model itself never imports torch.distributed. Full activation
checkpointing recounts every MoE layer once more in backward; that doubles all counts alike,
which the sign-based update ignores.
"""

from collections.abc import Callable

import torch
from torch import nn

from .router import TokenChoiceTopKRouter, expert_bias_deltas


def _routers(model: nn.Module) -> list[TokenChoiceTopKRouter]:
    return [m for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)]


@torch.no_grad()
def update_moe_load_balance(
    model: nn.Module,
    coeff: float,
    reduce_counts: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Move every router's `expert_bias` by `coeff * sign(mean - count)` and zero its counter.

    `reduce_counts`, if given, receives the stacked counters `[n_moe_layers, E]` (one collective
    for all layers) and must sum them in place across data-parallel ranks.
    """
    routers = _routers(model)
    if not routers:
        return
    counts_LE = torch.stack([r.tokens_per_expert for r in routers])
    if reduce_counts is not None:
        reduce_counts(counts_LE)
    # Every layer's step at once, each router's own update (`update_expert_bias`) done in a fixed
    # number of ops for the whole model instead of several per layer (each a launch on a GPU).
    biases = [r.expert_bias for r in routers]
    deltas_LE = expert_bias_deltas(counts_LE.to(biases[0].dtype), coeff)
    torch._foreach_add_(biases, list(deltas_LE.unbind(0)))
    torch._foreach_zero_([r.tokens_per_expert for r in routers])


def moe_aux_loss(
    model: nn.Module,
    sequence_parts: int = 1,
    reduce_counts: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor | float:
    """Sum of the sequence-wise balance losses left by the last forward (0.0 if none enabled).

    Read it right after the forward that produced it and add it to the loss before backward.

    When every sequence is split over `sequence_parts` ranks (context parallel), each rank saw
    part of each sequence: `reduce_counts` must sum the stacked expert-choice counts
    `[n_moe_layers, B, E]` in place over those ranks (one collective for all layers). Each rank
    then returns the loss with the whole sequences' counts and its own part of the affinities,
    scaled so that the mean over the parts is the exact loss (and its gradient reaches each
    token's affinities once, through the rank that holds the token).
    """
    routers = [r for r in _routers(model) if r.aux_loss is not None]
    local = [r.aux_loss for r in routers]
    for r in _routers(model):
        r.aux_loss = None  # consumed: a stale loss must not be added twice
    if not routers:
        return 0.0
    if sequence_parts == 1:
        return torch.stack(local).sum()
    chosen_LBE = torch.stack([r.aux_stats[0] for r in routers])
    if reduce_counts is not None:
        reduce_counts(chosen_LBE)
    # Exact: sum over parts of balance_loss(counts, P_part, S) / parts with S = parts x S_part,
    # P = mean of the parts' P; times parts, as the caller averages the parts' losses.
    losses = [
        r.balance_loss(chosen_BE, r.aux_stats[1], r.aux_stats[2] * sequence_parts)
        for r, chosen_BE in zip(routers, chosen_LBE)
    ]
    return torch.stack(losses).sum()
