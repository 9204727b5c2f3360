"""Token-choice mixture of experts: router, grouped experts, the MoE block, the permute kernel."""

from plait.models.common import FeedForward

from .experts import GroupedExperts
from .kernels import generate_permute_indices, permute_and_pad, unpermute
from .load_balance import configure_moe_aux_loss, moe_aux_loss, update_moe_load_balance
from .moe import MoE
from .router import TokenChoiceTopKRouter

__all__ = [
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "TokenChoiceTopKRouter",
    "configure_moe_aux_loss",
    "generate_permute_indices",
    "moe_aux_loss",
    "permute_and_pad",
    "unpermute",
    "update_moe_load_balance",
]
