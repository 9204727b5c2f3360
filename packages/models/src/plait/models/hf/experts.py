"""Routed experts between plait's stacked layout and Hugging Face's, for every MoE adapter.

plait stacks an MoE block's experts as `moe.experts.w1 / w2 / w3` `[E, in, out]`. Released HF
checkpoints (DeepSeek-V3, Qwen3-MoE, Kimi K2) hold one `nn.Linear` per expert,
`mlp.experts.{j}.gate_proj / down_proj / up_proj.weight` `[out, in]`; transformers 5 fuses them in
memory as `mlp.experts.gate_up_proj [E, 2*hidden, dim]` and `mlp.experts.down_proj [E, dim, hidden]`.
Import reads both HF forms; export writes the checkpoint form.
"""

import re

import torch

# plait stacked expert weight -> HF per-expert projection name.
PROJECTIONS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_HF_EXPERT_KEY = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def to_hf(prefix: str, suffix: str, tensor_EIO: torch.Tensor) -> dict[str, torch.Tensor]:
    """`{prefix}.mlp.experts.{j}.{projection}.weight` [out, in] for each expert of a stacked weight."""
    return {f"{prefix}.mlp.experts.{j}.{PROJECTIONS[suffix]}.weight": w_IO.t() for j, w_IO in enumerate(tensor_EIO.unbind(0))}


def is_hf_expert(suffix: str) -> bool:
    return bool(_HF_EXPERT_KEY.fullmatch(suffix)) or suffix in _FUSED


class ExpertCollector:
    """Gathers a state dict's HF expert tensors (either form), then stacks them the plait way."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        self.stacked: dict[str, torch.Tensor] = {}

    def add(self, prefix: str, suffix: str, tensor: torch.Tensor) -> None:
        """One HF tensor `suffix` of the block that plait names `prefix` (e.g. `layers.3`)."""
        if expert := _HF_EXPERT_KEY.fullmatch(suffix):
            self.per_expert.setdefault((prefix, expert.group(2)), {})[int(expert.group(1))] = tensor
        elif suffix == "mlp.experts.gate_up_proj":  # [E, 2*hidden, dim]
            w1, w3 = tensor.chunk(2, dim=1)
            self.stacked[f"{prefix}.moe.experts.w1"] = w1.transpose(1, 2)
            self.stacked[f"{prefix}.moe.experts.w3"] = w3.transpose(1, 2)
        else:  # mlp.experts.down_proj [E, dim, hidden]
            self.stacked[f"{prefix}.moe.experts.w2"] = tensor.transpose(1, 2)

    def result(self) -> dict[str, torch.Tensor]:
        """`{prefix}.moe.experts.wN` [E, in, out]; a block whose experts are not 0..E-1 raises KeyError."""
        projection_to_plait = {hf: plait for plait, hf in PROJECTIONS.items()}
        stacked = dict(self.stacked)
        for (prefix, projection), per_expert in self.per_expert.items():
            if sorted(per_expert) != list(range(self.n_experts)):
                raise KeyError(f"{prefix} {projection}: experts {sorted(per_expert)} != 0..{self.n_experts - 1}")
            stacked[f"{prefix}.{projection_to_plait[projection]}"] = torch.stack(
                [per_expert[j].t() for j in range(self.n_experts)]
            )
        return stacked
