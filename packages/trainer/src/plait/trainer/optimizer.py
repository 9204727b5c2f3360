"""AdamW: torch's with fp32 moments and the fastest kernel the device has (fused: one kernel over
all parameters, or foreach), or plait's with bf16 moments (optimizer.state_dtype = bf16,
adamw_bf16.py).

int8 moments (torchao's AdamW8bit) are refused. Measured with torchao 0.18 on torch 2.13 (FSDP2,
gloo, CPU): its states are DTensors of its 8-bit subclass and go through DCP, but it quantizes a
rank's shard only when the shard's size is a multiple of its 256-element block (else that shard's
states stay fp32), so which states are 8-bit, and the result, follow the layout: a [300, 320]
weight is 8-bit on one rank and fp32 on FSDP 2's two 150-row shards, 1.2e-3 apart after 3 steps.
It also wants the learning rate as a tensor (plait's LambdaLR sets floats) and compiles a kernel
per parameter shape (50 s before the first step on this CPU).
"""

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from .adamw_bf16 import AdamWBF16
from .config import ConfigError, OptimizerConfig

# Bytes of the two moments per parameter element, by optimizer.state_dtype.
MOMENT_BYTES = {"fp32": 8, "bf16": 4}


def check_state_dtype(config: OptimizerConfig) -> None:
    """One line for a state dtype that cannot run (before anything is built)."""
    if config.state_dtype == "int8":
        raise ConfigError(
            "optimizer.state_dtype = int8: torchao's AdamW8bit keeps 8-bit states only for shards whose size is a "
            "multiple of its 256-element block (the others stay fp32), so the result changes with the layout (FSDP 2 "
            "would not equal one rank); use --optimizer.state_dtype bf16 (12 bytes per parameter, layout-invariant) "
            "or fp32."
        )


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, device: torch.device, seed: int = 0
) -> torch.optim.Optimizer:
    """`seed` (job.seed) keys bf16's stochastic rounding."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if config.state_dtype == "bf16":
        return AdamWBF16(named, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                         seed=seed)  # fmt: skip
    fused = device.type in _get_fused_kernels_supported_devices()
    if config.implementation == "foreach" or (config.implementation == "auto" and not fused):
        kernel = {"foreach": True}
    else:
        kernel = {"fused": True}
    return torch.optim.AdamW(
        [p for _, p in named], lr=config.lr, betas=tuple(config.betas), eps=config.eps,
        weight_decay=config.weight_decay, **kernel,
    )  # fmt: skip


def state_dtype_of(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer.state_dtype a built optimizer keeps its moments in."""
    return "bf16" if isinstance(optimizer, AdamWBF16) else "fp32"
