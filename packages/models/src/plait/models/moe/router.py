"""Token-choice top-k router with DeepSeek's auxiliary-loss-free load balancing.

Each token picks `top_k` experts by score. A per-expert `expert_bias` is added to the scores only
to *select* experts; the weights that scale expert outputs come from the unbiased scores, so the
bias steers load without entering the gradient (DeepSeek-V3, arXiv:2408.15664). The bias moves
once per optimizer step from the token counts accumulated over all micro-batches of that step
(`update_expert_bias`), which keeps it exact under gradient accumulation.

The optional sequence-wise balance loss (DeepSeek-V3 eq. 17-20) trains inside the block's own
backward, as DeepSeek's `AddAuxiliaryLoss` does: the router ties it into its output weights with an
identity whose backward also gives the loss its gradient, and keeps only its detached value. (Left
on the router for the caller to add to the final loss, as it was before, the loss with its graph
stayed there; under activation checkpointing each block's recomputation left its own there, whose
graph held that block's recomputed activations until the next forward: by the end of the backward
every block's at once.)
"""

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.cpu_bf16 import Linear


@torch.no_grad()
def expert_bias_deltas(counts_LE: torch.Tensor, coeff: float) -> torch.Tensor:
    """The bias step of each row (one MoE layer's token counts per expert): `coeff` towards the
    mean load, `coeff * sign(mean - count)`, centred (only relative bias matters for top-k, so the
    bias stays centred). Rows are independent: a model's layers go in one stacked call, a few
    kernels in all instead of a few per layer. Each row gives the floats of its own [E] vector on
    the CPU (tested bitwise); on CUDA a row's reduction order may differ from a vector's, which can
    move the centring mean of the +-coeff steps in its last bit (the counts' mean is of whole
    numbers: exact in any order)."""
    delta_LE = coeff * torch.sign(counts_LE.mean(dim=-1, keepdim=True) - counts_LE)
    return delta_LE - delta_LE.mean(dim=-1, keepdim=True)


class _TieAuxLoss(torch.autograd.Function):
    """Identity on `y`; in `y`'s backward, `aux_loss` gets the gradient `weight`, as if `weight x
    aux_loss` were added to the objective (DeepSeek's `AddAuxiliaryLoss`). No saved tensors."""

    @staticmethod
    def forward(ctx, y, aux_loss, weight):
        ctx.weight, ctx.aux = weight, (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        # Same storage, no copy; not an autograd view of y.
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        shape, dtype, device = ctx.aux
        return grad_y, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class TokenChoiceTopKRouter(nn.Module):
    """Scores `[T, E]`, picks `top_k` experts per token, returns their weights and the counts.

    Args:
        score_func: "softmax" (DeepSeek-V2) or "sigmoid" (DeepSeek-V3); computed in fp32.
        route_norm: renormalise the top-k weights of a token to sum to 1.
        route_scale: multiply the final weights (DeepSeek's `routed_scaling_factor`).
        n_groups, topk_groups: group-limited routing: experts form `n_groups` equal groups and a
            token may only pick from its best `topk_groups` groups (bounds cross-node traffic).
        aux_loss_coeff: if > 0, the sequence-wise balance loss of DeepSeek-V3 (eq. 17-20) is
            computed in every training forward with gradients and tied into the returned weights
            (its gradient `aux_grad_scale`, arriving in this block's backward); its value is left on
            `self.aux_loss`. See `plait.models.moe.configure_moe_aux_loss` and `moe_aux_loss`.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        n_groups: int = 1,
        topk_groups: int = 1,
        aux_loss_coeff: float = 0.0,
    ):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if num_experts % n_groups != 0 or not 1 <= topk_groups <= n_groups:
            raise ValueError(f"bad expert groups: {num_experts=} {n_groups=} {topk_groups=}")
        self.gate = Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.n_groups = n_groups
        self.topk_groups = topk_groups
        self.aux_loss_coeff = aux_loss_coeff
        # The last training forward's balance loss, detached (to log); None after any other forward.
        self.aux_loss: torch.Tensor | None = None
        # Set by configure_moe_aux_loss: the gradient the loss gets (1 / micro-batches per step, ...),
        # and under context parallel the parts each sequence is split into and the counts' sum over them.
        self.aux_grad_scale = 1.0
        self.aux_sequence_parts = 1
        self.aux_reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Persistent: the bias is training state a checkpoint must carry (HF calls it
        # e_score_correction_bias). The counter is per-step scratch, so it is not saved.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)

    def _group_mask(self, scores_for_choice_TE: torch.Tensor) -> torch.Tensor:
        """Boolean `[T, E]`: True for experts inside the token's best `topk_groups` groups."""
        T = scores_for_choice_TE.shape[0]
        scores_TGe = scores_for_choice_TE.view(T, self.n_groups, -1)
        if self.score_func == "sigmoid":
            # DeepSeek-V3: a group is as good as its two best experts (HF does the same).
            group_scores_TG = scores_TGe.topk(2, dim=-1).values.sum(dim=-1)
        else:
            # DeepSeek-V2: a group is as good as its best expert.
            group_scores_TG = scores_TGe.amax(dim=-1)
        top_groups_TG = group_scores_TG.topk(self.topk_groups, dim=-1).indices
        mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, top_groups_TG, True)
        return mask_TG[:, :, None].expand_as(scores_TGe).reshape(T, -1)

    def forward(self, x_TD: torch.Tensor, num_seqs: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns top_scores_TK (fp32), selected_experts_TK (int64), num_tokens_per_expert_E (int64).

        `num_seqs` splits the T tokens into equal sequences for the sequence-wise aux loss.
        """
        logits_TE = self.gate(x_TD)
        # fp32 scores: bf16 softmax/sigmoid over many experts destabilises training.
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE.float())
        else:
            scores_TE = F.softmax(logits_TE.float(), dim=-1)

        # Stage 1: select. The bias only shifts the choice; it carries no gradient.
        scores_for_choice_TE = scores_TE.detach() + self.expert_bias
        if self.n_groups > 1:
            in_group_TE = self._group_mask(scores_for_choice_TE)
            scores_for_choice_TE = scores_for_choice_TE.masked_fill(~in_group_TE, float("-inf"))
        selected_experts_TK = scores_for_choice_TE.topk(self.top_k, dim=-1).indices

        # Stage 2: weight the choice with the unbiased scores.
        top_scores_TK = scores_TE.gather(1, selected_experts_TK)
        if self.route_norm:
            top_scores_TK = top_scores_TK / (top_scores_TK.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores_TK = top_scores_TK * self.route_scale

        # Stage 3: count. scatter_add keeps the shape static (bincount's is data-dependent).
        num_tokens_per_expert_E = torch.zeros(self.num_experts, dtype=torch.int64, device=x_TD.device).scatter_add_(
            0, selected_experts_TK.flatten(), torch.ones_like(selected_experts_TK.flatten())
        )
        if self.training:
            # Only training forwards feed the load-balance bias: an evaluation must not move it.
            with torch.no_grad():
                self.tokens_per_expert.add_(num_tokens_per_expert_E)

        self.aux_loss = None
        if self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            aux_loss = self._sequence_balance_loss(scores_TE, selected_experts_TK, num_seqs)
            self.aux_loss = aux_loss.detach()
            # The weights always feed the block's output: their backward, inside this block's,
            # starts the loss's (no eval or no-grad forward computes it).
            top_scores_TK = _TieAuxLoss.apply(top_scores_TK, aux_loss, self.aux_grad_scale)
        return top_scores_TK, selected_experts_TK, num_tokens_per_expert_E

    def _sequence_balance_loss(
        self, scores_TE: torch.Tensor, selected_experts_TK: torch.Tensor, num_seqs: int
    ) -> torch.Tensor:
        """alpha * sum_e f_e * P_e per sequence, averaged over sequences (DeepSeek-V3 eq. 17-20).

        Context parallel (`aux_sequence_parts` > 1): this rank holds a part of every sequence. The
        counts f_e are summed over the parts (`aux_reduce_counts`, one collective per layer) and
        P_e is this part's mean, so the mean of the parts' losses is the exact loss, and its
        gradient reaches each token's affinities once, through the rank that holds the token.
        """
        E, K = self.num_experts, self.top_k
        S = scores_TE.shape[0] // num_seqs
        # P_e: mean normalised affinity of expert e over the sequence (this rank's part of it).
        probs_BSE = (scores_TE / scores_TE.sum(dim=-1, keepdim=True)).view(num_seqs, S, E)
        P_BE = probs_BSE.mean(dim=1)
        # How often the sequence chose each expert (no gradient: f_e is a count).
        chosen_BE = torch.zeros(num_seqs, E, device=scores_TE.device).scatter_add_(
            1, selected_experts_TK.view(num_seqs, S * K), torch.ones(num_seqs, S * K, device=scores_TE.device)
        )
        if self.aux_reduce_counts is not None:
            chosen_BE = self.aux_reduce_counts(chosen_BE)
        # f_e: fraction of the sequence's selections that went to e, scaled so uniform == 1.
        f_BE = chosen_BE * E / (K * S * self.aux_sequence_parts)
        return self.aux_loss_coeff * (f_BE * P_BE).sum(dim=-1).mean()

    @torch.no_grad()
    def update_expert_bias(self, coeff: float, tokens_per_expert_E: torch.Tensor | None = None) -> None:
        """One load-balancing step: raise the bias of under-loaded experts, lower over-loaded ones.

        Call once per optimizer step, outside autograd. `tokens_per_expert_E` overrides the local
        counter (pass the counts summed over data-parallel ranks); the counter is reset either way.
        """
        counts_E = self.tokens_per_expert if tokens_per_expert_E is None else tokens_per_expert_E
        self.expert_bias.add_(expert_bias_deltas(counts_E[None].to(self.expert_bias.dtype), coeff)[0])
        self.tokens_per_expert.zero_()

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
