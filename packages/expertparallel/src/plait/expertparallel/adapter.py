"""Handing a model's own experts to `apply_expert_parallel` (a model plait did not write).

What expert parallel needs of an experts module (docs/contracts.md, "Your own model: expert
parallel"), checked by `apply_expert_parallel` before its first collective:
- every parameter the module owns directly holds the experts on dim 0 (`[E, ...]`), and its
  sub-modules own none: expert parallel shards that dim and nothing else;
- `forward(routed_input_ND, num_tokens_per_expert_E)`, called positionally: rows sorted by expert,
  counts over the experts it holds (the local ones under expert parallel, whose weights are then
  DTensors: compute on `local(w)`), one output row per input row;
- `permute_and_pad` / `unpermute`: the reorder of received rows (source rank, local expert) ->
  expert-major. The torch versions here need no host sync; plait-models has a Triton one.

`StackedExperts` makes such a module out of E per-expert modules (an `nn.ModuleList` of MLPs, as
in Mixtral), each expert keeping its own forward.
"""

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call


def local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight expert parallel sharded (a DTensor), or the weight itself."""
    return w.to_local() if hasattr(type(w), "to_local") else w


def permute_and_pad(x_ND, tokens_per_expert_group, ep_degree, num_local_experts, alignment=1):
    """Rows grouped (source rank, local expert) -> expert-major, every group padded with zero rows
    to a multiple of `alignment`, into a static length. Returns `(x_padded_PD, permuted_indices_P
    (-1 for padding), m_sizes_E)`; no host sync. The experts contract's signature."""
    N, D = x_ND.shape
    counts_RE = tokens_per_expert_group.view(ep_degree, num_local_experts)
    group_N = torch.repeat_interleave(
        torch.arange(ep_degree * num_local_experts, device=x_ND.device), tokens_per_expert_group, output_size=N
    )
    # A stable sort on the local expert: expert-major, source ranks in order inside each expert.
    order_N = torch.argsort(group_N % num_local_experts, stable=True)
    tokens_E = counts_RE.sum(0)
    m_sizes_E = (tokens_E + alignment - 1) // alignment * alignment
    expert_N = torch.repeat_interleave(torch.arange(num_local_experts, device=x_ND.device), tokens_E, output_size=N)
    # Sorted row i moves past the padding of the groups before its expert's.
    pad_E = m_sizes_E - tokens_E
    dst_N = torch.arange(N, device=x_ND.device) + (torch.cumsum(pad_E, 0) - pad_E)[expert_N]
    P = -(-(N + num_local_experts * (alignment - 1)) // alignment) * alignment  # every group wastes < alignment rows
    permuted_P = torch.full((P,), -1, dtype=torch.int64, device=x_ND.device).index_copy(0, dst_N, order_N)
    x_ext_ND = torch.cat([x_ND, x_ND.new_zeros(1, D)])  # padding reads an appended zero row
    # masked_fill with a number, not `where`: no device tensor made of the number (a launch).
    return x_ext_ND[permuted_P.masked_fill(permuted_P < 0, N)], permuted_P, m_sizes_E


def unpermute(y_padded_PD, permuted_indices_P, num_rows):
    """Inverse of `permute_and_pad`: the rows back in received order; padding is never read."""
    P = permuted_indices_P.shape[0]
    target_P = permuted_indices_P.masked_fill(permuted_indices_P < 0, num_rows)
    inverse_N = torch.zeros(num_rows + 1, dtype=torch.int64, device=permuted_indices_P.device)
    inverse_N.scatter_(0, target_P, torch.arange(P, device=permuted_indices_P.device))
    return y_padded_PD[inverse_N[:num_rows]]


class StackedExperts(nn.Module):
    """E identical per-expert modules as one experts module: each parameter of the experts is
    stacked on a new dim 0 (`experts[e].w1.weight` -> `w1_weight[e]`, the expert's own layout),
    and `forward(x_ND, num_tokens_per_expert_E)` runs expert e's own forward on its rows with its
    slice of the stacked weights. Build it from the loaded per-expert modules (that converts the
    checkpoint); `unstack()` gives them back.

    The loop over experts needs the group sizes on the host: one `.tolist()` per call, besides the
    dispatch's one. An experts module over stacked weights with `torch._grouped_mm` has none."""

    permute_and_pad = staticmethod(permute_and_pad)
    unpermute = staticmethod(unpermute)

    def __init__(self, experts: Sequence[nn.Module]):
        super().__init__()
        first = experts[0]
        shapes = {name: p.shape for name, p in first.named_parameters()}
        for e, expert in enumerate(experts):
            got = {name: p.shape for name, p in expert.named_parameters()}
            if got != shapes or next(expert.buffers(), None) is not None:
                raise ValueError(
                    f"StackedExperts: expert {e} ({type(expert).__name__}) has parameters {got}, expert 0 {shapes}"
                    " (buffers: none allowed): stacking needs E experts with the same parameters and no buffers."
                )
        self.num_experts = len(experts)
        self.names = {name.replace(".", "_"): name for name in shapes}  # stacked -> the expert's own name
        for stacked, name in self.names.items():
            weights = [expert.get_parameter(name).detach() for expert in experts]
            self.register_parameter(stacked, nn.Parameter(torch.stack(weights)))
        # Runs every expert with the weights it is handed; its own are never used, so it holds no
        # memory (meta) and stays out of the module tree (a list): nothing else sees or shards it.
        self._template = [copy.deepcopy(first).to("meta")]

    def forward(self, x_ND: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        weights = {name: local(getattr(self, stacked)) for stacked, name in self.names.items()}
        counts = num_tokens_per_expert_E.tolist()  # the loop's split sizes (a host sync)
        used = sum(counts)
        y = [
            functional_call(self._template[0], {name: w[e] for name, w in weights.items()}, (x_chunk,))
            for e, x_chunk in enumerate(torch.split(x_ND[:used], counts))
        ]
        # Rows past the groups (a padded buffer's tail) come out as zeros.
        y.append(x_ND.new_zeros(x_ND.shape[0] - used, *y[0].shape[1:]))
        return torch.cat(y)

    def unstack(self) -> nn.ModuleList:
        """The per-expert modules with the current weights (to save in the model's own format).
        Under expert parallel every rank must call it: each weight is gathered (`full_tensor`)."""
        full = {}
        for stacked, name in self.names.items():
            w = getattr(self, stacked).detach()
            full[name] = w.full_tensor() if hasattr(type(w), "full_tensor") else w
        experts = nn.ModuleList()
        for e in range(self.num_experts):
            expert = copy.deepcopy(self._template[0]).to_empty(device=next(iter(full.values())).device)
            for name, w in full.items():
                expert.get_parameter(name).data.copy_(w[e])
            experts.append(expert)
        return experts


__all__ = ["StackedExperts", "local", "permute_and_pad", "unpermute"]
