"""plait.expertparallel: dp2ep expert parallel with dropless all-to-all dispatch.

    dispatchers = apply_expert_parallel(model, meshes.ep, info["experts"])

See the package README and docs/contracts.md (the experts contract it relies on).
"""

from .adapter import StackedExperts, local, permute_and_pad, unpermute
from .api import ExpertParallelConfig, apply_expert_parallel, validate_expert_parallel
from .capacity import CapacityDispatcher, capacity_per_expert
from .dispatch import AllToAllDispatcher
from .transformers_experts import TransformersExperts, adapt_transformers_experts

__version__ = "0.2.0"

__all__ = [
    "AllToAllDispatcher",
    "CapacityDispatcher",
    "StackedExperts",
    "TransformersExperts",
    "ExpertParallelConfig",
    "adapt_transformers_experts",
    "apply_expert_parallel",
    "capacity_per_expert",
    "local",
    "permute_and_pad",
    "unpermute",
    "validate_expert_parallel",
]
