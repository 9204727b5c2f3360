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
        return x_TD.index_select(0, sorted_pairs_N // K)

    @staticmethod
    def backward(ctx, grad_ND):
        (pair_rank_N,) = ctx.saved_tensors
        D = grad_ND.shape[-1]
        return grad_ND.index_select(0, pair_rank_N).view(-1, ctx.K, D).sum(dim=1), None, None, None


class _PermuteRows(torch.autograd.Function):
    """`x_ND[index_N]` for a permutation `index_N`; the backward gathers with the inverse
    permutation instead of index_put's accumulate (a sort on CPU, atomics on CUDA)."""

    @staticmethod
    def forward(ctx, x_ND, index_N, inverse_N):
        ctx.save_for_backward(inverse_N)
        return x_ND.index_select(0, index_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (inverse_N,) = ctx.saved_tensors
        return grad_ND.index_select(0, inverse_N), None, None


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
        deterministic = torch.are_deterministic_algorithms_enabled()  # training.deterministic
        if deterministic:
            # Where each (token, choice) pair sits in the sorted order: the inverse permutation.
            pair_rank_N = torch.empty_like(sorted_pairs_N).scatter_(
                0, sorted_pairs_N, torch.arange(sorted_pairs_N.numel(), device=x_TD.device)
            )
            routed_input_ND = _GatherTokens.apply(x_TD, sorted_pairs_N, pair_rank_N, K)
        else:
            token_ids_N = sorted_pairs_N // K
            top_scores_N = top_scores_TK.flatten()[sorted_pairs_N]
            routed_input_ND = x_TD[token_ids_N]
        # Experts: [N, D] -> [N, D].
        routed_output_ND = self.experts(routed_input_ND, num_tokens_per_expert_E)
        # The shared experts need nothing routed, so they run before the routed output is first
        # used: whatever is still in flight for it (expert parallel's combine all-to-all, waited on
        # at first use) overlaps with them. In one process the order changes nothing.
        shared_TD = self.shared_experts(x_TD) if self.shared_experts is not None else None
        if deterministic:
            out_TD = self._combine_deterministic(
                routed_output_ND, top_scores_TK, sorted_pairs_N, pair_rank_N, x_TD.dtype
            )
        else:
            # Unpermute: weight in fp32, then sum each token's K outputs back into its row. (On
            # CUDA scatter_add's float atomics make the sum order vary from run to run.)
            routed_output_ND = (routed_output_ND.float() * top_scores_N[:, None]).to(x_TD.dtype)
            out_TD = torch.zeros_like(x_TD).scatter_add_(0, token_ids_N[:, None].expand(-1, D), routed_output_ND)

        if shared_TD is not None:
            out_TD = out_TD + shared_TD
        return out_TD.view(B, S, D)

    def _combine_deterministic(self, routed_output_ND, top_scores_TK, sorted_pairs_N, pair_rank_N, dtype):
        """The deterministic path (training.deterministic) gathers tokens and combines outputs with
        no float accumulation whose order can vary: every gather is a permutation or its inverse,
        and each token's K outputs are summed side by side (token-major, gather + sum over K)
        instead of scatter-added; so is the token gather's gradient (`_GatherTokens`). Measured on
        CPU (T 4096, K 4, D 512, one thread) 1.2-1.3x the scatter_add form's time for permute +
        combine alone, hence only when deterministic algorithms are asked."""
        T, K = top_scores_TK.shape
        y_TKD = _PermuteRows.apply(routed_output_ND, pair_rank_N, sorted_pairs_N).view(T, K, -1)
        # Weighted in fp32 and cast, as the scatter form does; summed over K in a fixed order.
        return (y_TKD.float() * top_scores_TK[:, :, None]).to(dtype).sum(dim=1)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
