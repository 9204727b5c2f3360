"""What the trainer calls on a whole model: the per-step bias update and the optional aux loss.

Trainer use (one optimizer step of N micro-batches):

    configure_moe_aux_loss(model, grad_scale=1 / N)   # aux loss opt-in (aux_loss_coeff > 0)
    for micro_batch in step:
        logits = model(tokens)
        loss = cross_entropy(logits, labels) / N      # the aux loss trains itself, see below
        loss.backward()
        log(moe_aux_loss(model))                      # its value, if wanted
    optimizer.step()
    update_moe_load_balance(model, coeff=1e-3, reduce_counts=all_reduce_over_dp_cp)

(or register `update_moe_load_balance` as an optimizer step pre-hook). The routers count tokens
in every forward; the update reads the counts of the whole step, so the result is the same for
one big batch or many micro-batches. Under data parallel each rank sees different tokens, so
pass `reduce_counts` (an in-place SUM all-reduce over the dp x cp ranks) to keep the bias
identical everywhere; the model itself never imports torch.distributed. Full activation
checkpointing recounts every MoE layer once more in backward; that doubles all counts alike,
which the sign-based update ignores.

The sequence-wise aux loss is not added to the loss: each router ties it into its own output,
so its gradient is made inside that MoE block's backward, and no graph is left on the module
(under activation checkpointing a loss left there by a block's recomputation would hold that
block's recomputed activations to the end of the backward; router.py). `configure_moe_aux_loss`
sets the weight of its gradient, as if `grad_scale x aux loss` were added to each forward's
objective; `moe_aux_loss` reads the value.
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


def configure_moe_aux_loss(
    model: nn.Module,
    grad_scale: float = 1.0,
    sequence_parts: int = 1,
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """How every router's sequence-wise balance loss trains (routers with `aux_loss_coeff > 0`).

    `grad_scale`: the gradient each training forward's losses get, as if `grad_scale x` their
    sum were added to the objective: 1 / N for N micro-batches per optimizer step (the objective
    averages them); under tensor parallel also 1 / tp, as every TP rank computes the same loss
    inside the MoE's TP region, whose entry sums the ranks' input gradients.

    Context parallel: every sequence is split over `sequence_parts` ranks, each routing its part.
    `reduce_counts(counts_BE)` returns a layer's expert-choice counts `[B, E]` summed over those
    ranks (a collective, called in the router's forward, once per MoE layer; recomputed with it
    under full activation checkpointing); each rank's loss then has the whole sequences' counts
    and its own part's affinities, so that the mean over the parts is the exact loss (data
    parallel's gradient average over the cp ranks takes that mean).
    """
    if sequence_parts > 1 and reduce_counts is None:
        raise ValueError(f"sequence_parts = {sequence_parts} needs reduce_counts (the counts' sum over the parts)")
    for router in _routers(model):
        router.aux_grad_scale = grad_scale
        router.aux_sequence_parts = sequence_parts
        router.aux_reduce_counts = reduce_counts


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The sequence-wise balance losses of the last training forward, summed (0.0 if none): a
    detached value, to log. Training needs no call: the loss is already tied into each MoE
    block's output (adding this value to the loss changes no gradient). Under context parallel
    a rank's value is its part's (the mean over the parts is the loss)."""
    losses = [r.aux_loss for r in _routers(model) if r.aux_loss is not None]
    return torch.stack(losses).sum() if losses else 0.0
