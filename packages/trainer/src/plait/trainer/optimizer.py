"""AdamW with the fastest kernel the device has: fused (one kernel over all parameters) or foreach."""

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from .config import OptimizerConfig


def build_optimizer(model: nn.Module, config: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type in _get_fused_kernels_supported_devices()
    if config.implementation == "foreach" or (config.implementation == "auto" and not fused):
        kernel = {"foreach": True}
    else:
        kernel = {"fused": True}
    return torch.optim.AdamW(
        params, lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay, **kernel
    )
