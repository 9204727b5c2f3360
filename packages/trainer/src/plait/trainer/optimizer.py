"""AdamW: torch's with fp32 moments and the fastest kernel the device has (fused: one kernel over
all parameters, or foreach), or plait's with bf16 moments (optimizer.state_dtype = bf16,
adamw_bf16.py).

int8 moments (torchao's AdamW8bit) are refused: it quantizes each rank's shard in blocks of 256
elements with one scale per block, so the blocks, and with them the result, move with the layout
(FSDP 2 would not equal one rank), and on a CPU it compiles a kernel per parameter shape first
(measured: 50 s before the first step of a two-layer model).
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
            "optimizer.state_dtype = int8: torchao's AdamW8bit quantizes each rank's shard in blocks with their own "
            "scales, so the result would change with the layout (and its resharded checkpoints with it); use "
            "--optimizer.state_dtype bf16 (12 bytes per parameter, layout-invariant) or fp32."
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
