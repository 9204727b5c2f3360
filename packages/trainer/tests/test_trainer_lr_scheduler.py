"""Learning-rate schedules: warmup, then linear / cosine / wsd / none."""

import math

import pytest
import torch

from plait.trainer.config import LRSchedulerConfig
from plait.trainer.lr_scheduler import build_lr_scheduler, lr_factor


def factors(steps, **kw):
    config = LRSchedulerConfig(**kw)
    return [lr_factor(s, steps, config) for s in range(steps)]


def test_warmup_reaches_peak_at_last_warmup_step():
    f = factors(20, warmup_steps=4, decay="none")
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f[4:] == [1.0] * 16


def test_linear_decay_to_min():
    f = factors(14, warmup_steps=4, decay="linear", min_lr_ratio=0.1)
    decay = f[4:]
    assert decay[0] == 1.0
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(1.0 - 0.9 * 9 / 10)
    assert min(f) >= 0.1


def test_cosine_midpoint_and_shape():
    f = factors(104, warmup_steps=4, decay="cosine", min_lr_ratio=0.0)
    assert f[4] == 1.0
    assert f[54] == pytest.approx(0.5)
    assert f[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 99 / 100)))


def test_wsd_holds_then_decays_over_the_last_fraction():
    f = factors(110, warmup_steps=10, decay="wsd", decay_ratio=0.2, min_lr_ratio=0.0)
    assert f[10:90] == [1.0] * 80  # stable
    tail = f[90:]
    assert len(tail) == 20 and tail[0] == 1.0
    assert all(a > b for a, b in zip(tail, tail[1:]))
    assert tail[-1] == pytest.approx(1 / 20)


def test_no_warmup_and_single_step():
    assert factors(1, warmup_steps=0, decay="linear") == [1.0]
    assert factors(3, warmup_steps=5, decay="cosine") == pytest.approx([0.2, 0.4, 0.6])


def test_lambda_lr_drives_the_optimizer():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=0.1)
    sched = build_lr_scheduler(opt, 10, LRSchedulerConfig(warmup_steps=2, decay="linear"))
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1 * x for x in factors(10, warmup_steps=2, decay="linear")])
