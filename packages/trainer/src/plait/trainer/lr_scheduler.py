"""Warmup, then linear / cosine / warmup-stable-decay, as a multiplier of the peak lr (LambdaLR).

Step s (0-based) trains with lr * lr_factor(s): linear warmup (s+1)/warmup_steps reaches the
peak at the last warmup step, then the decay runs over the remaining steps towards
min_lr_ratio (reached one step after the last, so no step trains with lr = min).
"""

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from .config import LRSchedulerConfig


def lr_factor(step: int, total_steps: int, config: LRSchedulerConfig) -> float:
    warmup = max(0, config.warmup_steps)
    if step < warmup:
        return (step + 1) / warmup
    if config.decay == "none":
        return 1.0
    decay_steps = max(0, total_steps - warmup)
    if config.decay == "wsd":
        decay_steps = max(1, round(config.decay_ratio * decay_steps)) if decay_steps else 0
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    # progress 0 at the first decay step, (n-1)/n at the last: no step is wasted on lr = min.
    progress = min(1.0, (step - decay_start) / decay_steps)
    lo = config.min_lr_ratio
    if config.decay == "cosine":
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - lo) * progress  # linear and wsd


def build_lr_scheduler(optimizer: Optimizer, total_steps: int, config: LRSchedulerConfig) -> LambdaLR:
    return LambdaLR(optimizer, functools.partial(lr_factor, total_steps=total_steps, config=config))
