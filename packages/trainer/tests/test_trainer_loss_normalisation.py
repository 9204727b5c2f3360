"""The step loss is the mean over every valid token of the global batch: splitting a batch with
ignored labels (-100) into micro-batches of unequal valid counts changes neither the reported
loss nor the update (a mean of per-micro-batch means would)."""

import pytest
import torch

from plait.trainer.config import build_config
from plait.trainer.train import Trainer


def _trainer(dump):
    overrides = {
        "job": {"dump_folder": str(dump)},
        "training": {"steps": 1, "seq_len": 32, "local_batch_size": 4, "dtype": "float32", "deterministic": True},
        "metrics": {"cpu_peak_tflops": 0.1},
    }
    trainer = Trainer(build_config(overrides))
    # The gradients the optimizer is given (Adam's first step is ~lr * sign(g): compare g itself).
    trainer.grads = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: trainer.grads.update({n: p.grad.clone() for n, p in trainer.pm.inner.named_parameters()})
    )
    return trainer


def test_micro_batches_with_ignored_labels_match_one_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (4, 33), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :28] = -100  # micro-batch 1: 4 valid tokens; micro-batch 2: 96
    labels[2, ::3] = -100

    whole = _trainer(tmp_path / "whole")
    loss_whole, _ = whole.train_step([(inputs, labels)])
    split = _trainer(tmp_path / "split")
    loss_split, _ = split.train_step([(inputs[:1], labels[:1]), (inputs[1:], labels[1:])])

    valid = labels != -100
    assert loss_split.item() == pytest.approx(loss_whole.item(), abs=1e-6)
    with torch.no_grad():
        logits = _trainer(tmp_path / "ref").model(inputs)
        expected = torch.nn.functional.cross_entropy(logits[valid], labels[valid])
    assert loss_whole.item() == pytest.approx(expected.item(), abs=1e-5)
    assert whole.grads and set(whole.grads) == set(split.grads)
    for name, grad in whole.grads.items():
        torch.testing.assert_close(split.grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)
