"""Validation must not change training: a DeepSeek-V3 run that evaluates every 2 steps has the same
losses and the same expert-load-balance bias as one that never evaluates (routers count only
training forwards; validation runs in eval mode)."""

import pytest
import torch

from plait.models.moe.router import TokenChoiceTopKRouter
from plait.testing.trainer import losses
from plait.trainer.config import build_config
from plait.trainer.train import Trainer


def _run(dump, validate: bool):
    overrides = {
        "job": {"dump_folder": str(dump)},
        "model": {"name": "deepseek_v3", "flavor": "debugmodel"},
        "training": {"steps": 4, "seq_len": 64, "local_batch_size": 2, "dtype": "float32", "deterministic": True},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"log_freq": 1, "cpu_peak_tflops": 0.1},
        "data": {"val_dataset": "builtin", "val_interval": 2 if validate else 0, "val_steps": 2},
    }
    trainer = Trainer(build_config(overrides))
    trainer.train()
    routers = [m for m in trainer.pm.inner.modules() if isinstance(m, TokenChoiceTopKRouter)]
    assert routers and trainer.pm.inner.training  # back in train mode after validating
    return losses(dump), [r.expert_bias.clone() for r in routers]


def test_validation_changes_neither_losses_nor_expert_bias(tmp_path):
    plain_losses, plain_bias = _run(tmp_path / "plain", validate=False)
    val_losses, val_bias = _run(tmp_path / "val", validate=True)
    assert val_losses == pytest.approx(plain_losses, abs=0, rel=0)
    assert any(b.abs().sum() > 0 for b in plain_bias)  # the bias did move during training
    for a, b in zip(plain_bias, val_bias):
        assert torch.equal(a, b)
