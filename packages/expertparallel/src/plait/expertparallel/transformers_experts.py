"""transformers 5's MoE experts under expert parallel, with transformers' parameter names kept.

transformers 5 stacks each MoE layer's experts in one module (Qwen3-MoE, Mixtral, ...):
`gate_up_proj [E, 2F, D]` and `down_proj [E, D, F]` (nn.Linear's [out, in] layout), called by its
MoE block as `experts(hidden_states_TD, top_k_index_TK, top_k_weights_TK)`, which routes, computes
and sums the top-k outputs in one call. Expert parallel needs a narrower call site,
`experts(routed_input_ND, num_tokens_per_expert_E)` (docs/contracts.md), to hook its dispatch and
combine around the expert compute only.

`adapt_transformers_experts(model)` puts `TransformersExperts` in front of each such module's class,
in place (as FSDP2's `fully_shard` does): the module object and its Parameters are the same, so
the state_dict keys stay transformers' (`model.layers.0.mlp.experts.gate_up_proj`), a checkpoint
loads before or after adaptation, and transformers' own `isinstance` checks (weight init) still
hold. Its `__call__` takes transformers' call and splits it in three: sort the (token, choice)
pairs by expert, the contract call through `nn.Module.__call__` (where expert parallel's hooks
sit), and the weighted sum over the top-k choices. Nothing here imports transformers.
"""

import torch
from torch import nn

from .adapter import local, permute_and_pad, unpermute

# What transformers' `use_experts_implementation` decorator records on an experts module, and the
# value the grouped GEMMs below are written for (Qwen3-MoE's and Mixtral's).
_SUPPORTED_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "has_post_expert_norm": False}


class TransformersExperts(nn.Module):
    """Placed in front of a transformers 5 experts class by `adapt_transformers_experts`; not
    built on its own. Keeps the experts contract: `forward(routed_input_ND,
    num_tokens_per_expert_E)` runs the (local) experts with `torch._grouped_mm`, no host sync."""

    permute_and_pad = staticmethod(permute_and_pad)
    unpermute = staticmethod(unpermute)
    group_alignment = 8  # rows per expert group (one rank or expert parallel): torch._grouped_mm's 16-byte rule

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        """transformers' call site: `hidden_states [T, D]`, `top_k_index [T, K]`, `top_k_weights [T, K]`
        -> the weighted sum of each token's K expert outputs `[T, D]`."""
        x_TD, experts_TK = hidden_states, top_k_index
        T, K = experts_TK.shape
        expert_N = experts_TK.reshape(-1)
        # (token, choice) pairs grouped by expert; scatter_add keeps the counts' shape static
        # (bincount's is data-dependent: a host sync on CUDA).
        order_N = torch.argsort(expert_N, stable=True)
        num_tokens_per_expert_E = torch.zeros(self.num_experts, dtype=torch.int64, device=x_TD.device).scatter_add_(
            0, expert_N, torch.ones_like(expert_N)
        )
        rows_ND = x_TD[order_N // K]
        if getattr(self, "dispatched_by_expert_parallel", False):
            # The experts contract's call: expert parallel's dispatch and combine hooks run around
            # it, and its dispatch pads the groups it receives.
            y_ND = super().__call__(rows_ND, num_tokens_per_expert_E)
        else:  # one rank: each expert's rows padded to group_alignment, as plait's own experts are
            padded_PD, permuted_P, m_sizes_E = self.permute_and_pad(
                rows_ND, num_tokens_per_expert_E, 1, self.num_experts, self.group_alignment
            )
            y_ND = self.unpermute(super().__call__(padded_PD, m_sizes_E), permuted_P, rows_ND.shape[0])
        y_ND = y_ND * top_k_weights.reshape(-1)[order_N, None]
        # Back to (token, choice) order and summed over the choices: a fixed order, no atomics.
        y_TKD = torch.empty_like(y_ND).index_copy_(0, order_N, y_ND).view(T, K, -1)
        return y_TKD.sum(1).to(x_TD.dtype)

    def forward(self, routed_input_ND: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        gate_up_EGD = local(self.gate_up_proj)  # [E_local, 2F, D]: this rank's experts under expert parallel
        down_EDF = local(self.down_proj)  # [E_local, D, F]
        N = routed_input_ND.shape[0]
        offsets_E = torch.cumsum(num_tokens_per_expert_E, 0, dtype=torch.int32)
        # grouped_mm leaves rows past the last group (a padded buffer's tail) undefined: zero them.
        past_N1 = (torch.arange(N, device=routed_input_ND.device) >= offsets_E[-1])[:, None]
        x_ND = routed_input_ND.masked_fill(past_N1, 0.0)
        h_NG = torch._grouped_mm(x_ND, gate_up_EGD.transpose(-2, -1), offs=offsets_E)
        h_NF = self._apply_gate(h_NG)  # the model's own gating: act(gate) * up for Qwen3-MoE and Mixtral
        y_ND = torch._grouped_mm(h_NF, down_EDF.transpose(-2, -1), offs=offsets_E)
        return y_ND.masked_fill(past_N1, 0.0)


_ADAPTED: dict[type, type] = {}  # transformers experts class -> its adapted class (one per class)


def _is_transformers_experts(module: nn.Module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    return {"gate_up_proj", "down_proj"} <= own.keys() and own["gate_up_proj"].dim() == 3


def _check_layout(path: str, module: nn.Module) -> None:
    for flag, supported in _SUPPORTED_LAYOUT.items():
        if getattr(module, flag, supported) != supported:
            raise ValueError(
                f"adapt_transformers_experts: {path!r} ({type(module).__name__}) has {flag} = {not supported}: "
                f"only experts with {flag} = {supported} are supported (Qwen3-MoE's and Mixtral's layout)."
            )
    if not hasattr(module, "num_experts") or not callable(getattr(module, "_apply_gate", None)):
        raise ValueError(
            f"adapt_transformers_experts: {path!r} ({type(module).__name__}) has no num_experts or _apply_gate: "
            "it needs transformers 5's experts class (decorated with use_experts_implementation)."
        )


def adapt_transformers_experts(model: nn.Module) -> list[str]:
    """Adapt every transformers 5 experts module of `model` (a module holding `gate_up_proj` and
    `down_proj` `[E, ...]` itself) in place to the experts contract; return their paths, for
    `apply_expert_parallel(model, meshes.ep, paths)` and plait-dataparallel's `expert_modules`.

    Same module objects, same Parameters, same names; calling the model is unchanged (the experts
    then compute with grouped GEMMs instead of transformers' `experts_implementation`). Call it
    before expert parallel and data parallel; loading a checkpoint may come before or after.
    Idempotent; every module is checked before the first is changed."""
    found = {path: m for path, m in model.named_modules() if _is_transformers_experts(m)}
    if not found:
        raise ValueError(
            f"adapt_transformers_experts: {type(model).__name__} has no module holding gate_up_proj and down_proj "
            "[E, ...]: pass a transformers 5 MoE model (Qwen3-MoE, Mixtral, ...)."
        )
    for path, module in found.items():
        _check_layout(path, module)
    for module in found.values():
        cls = type(module)
        if not issubclass(cls, TransformersExperts):
            if cls not in _ADAPTED:
                _ADAPTED[cls] = type(f"EP{cls.__name__}", (TransformersExperts, cls), {})
            module.__class__ = _ADAPTED[cls]
    return list(found)


__all__ = ["TransformersExperts", "adapt_transformers_experts"]
