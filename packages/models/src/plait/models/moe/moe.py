"""The MoE block: router -> sort by expert -> routed experts -> weight -> combine, plus shared experts.

Staged like Megatron-Core (route / permute / experts / unpermute) so each stage has one job and
expert parallel can wrap the middle one: its hooks on `self.experts` receive exactly
`(routed_input_ND, num_tokens_per_expert_E)` and must hand back `routed_output_ND`.
"""

import torch
from torch import nn

from plait.models.common import FeedForward

from .experts import GroupedExperts
from .router import TokenChoiceTopKRouter


class _GatherTokens(torch.autograd.Function):
    """`x_TD[token of each sorted pair]`, whose backward sums each token's K pair gradients
    token-major (gather + sum over K) instead of index_put's accumulate: deterministic on CUDA."""

    @staticmethod
    def forward(ctx, x_TD, sorted_pairs_N, pair_rank_N, K):
        ctx.save_for_backward(pair_rank_N)
        ctx.K = K
        return x_TD[sorted_pairs_N // K]

    @staticmethod
    def backward(ctx, grad_ND):
        (pair_rank_N,) = ctx.saved_tensors
        D = grad_ND.shape[-1]
        return grad_ND[pair_rank_N].view(-1, ctx.K, D).sum(dim=1), None, None, None


class MoE(nn.Module):
    """`y = shared_experts(x) + sum_k score_k * expert_k(x)` for every token.

    Module names are part of the tensor-parallel contract: `router.gate`, `experts`,
    `shared_experts.w1/w2/w3`. Scores multiply expert *outputs* (torchtitan's default), so the
    experts see raw tokens and the weighting stays in fp32.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        num_shared_experts: int,
        router: TokenChoiceTopKRouter,
        use_grouped_mm: bool = True,
    ):
        super().__init__()
        self.router = router
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, use_grouped_mm)
        self.shared_experts = FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts > 0 else None

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        K = self.router.top_k

        # Route: [T, K] weights and experts, [E] counts.
        top_scores_TK, selected_experts_TK, num_tokens_per_expert_E = self.router(x_TD, num_seqs=B)

        # Permute: N = T*K (token, choice) pairs sorted by expert. Stable, so within an expert
        # tokens keep sequence order and results do not depend on the sort implementation.
        sorted_pairs_N = torch.argsort(selected_experts_TK.flatten(), stable=True)
        # Where each (token, choice) pair sits in the sorted order: the inverse permutation.
        pair_rank_N = torch.empty_like(sorted_pairs_N).scatter_(
            0, sorted_pairs_N, torch.arange(sorted_pairs_N.numel(), device=x_TD.device)
        )
        routed_input_ND = _GatherTokens.apply(x_TD, sorted_pairs_N, pair_rank_N, K)

        # Experts: [N, D] -> [N, D].
        routed_output_ND = self.experts(routed_input_ND, num_tokens_per_expert_E)

        # Unpermute and combine, token-major: gather each token's K outputs next to each other
        # (a permutation, so its backward writes every row once) and sum them in a fixed order.
        # No scatter_add: on CUDA its float atomics make the sum order, hence the bits, vary from
        # run to run; this form is deterministic and measured as fast on CPU. Weighted and summed
        # in fp32, cast once.
        y_TKD = routed_output_ND[pair_rank_N].view(B * S, K, D)
        out_TD = (y_TKD.float() * top_scores_TK[:, :, None]).sum(dim=1).to(x_TD.dtype)

        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(B, S, D)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
