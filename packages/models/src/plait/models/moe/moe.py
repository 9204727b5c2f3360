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
        token_ids_N = sorted_pairs_N // K
        top_scores_N = top_scores_TK.flatten()[sorted_pairs_N]
        routed_input_ND = x_TD[token_ids_N]

        # Experts: [N, D] -> [N, D].
        routed_output_ND = self.experts(routed_input_ND, num_tokens_per_expert_E)

        # Unpermute: weight in fp32, then sum each token's K outputs back into its row.
        routed_output_ND = (routed_output_ND.float() * top_scores_N[:, None]).to(x_TD.dtype)
        out_TD = torch.zeros_like(x_TD).scatter_add_(0, token_ids_N[:, None].expand(-1, D), routed_output_ND)

        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(B, S, D)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
