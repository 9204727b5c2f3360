"""Activation checkpointing changes memory, not math: same loss and gradients, same module paths."""

import pytest
import torch
import torch.nn.functional as F

from plait.models import build_model
from plait.trainer.activation_checkpoint import apply_activation_checkpointing


def _grads(mode: str, every: int = 1):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model("llama3", "debugmodel", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model.to_empty(device="cpu")
    model.init_weights()
    names_before = [n for n, _ in model.named_parameters()]
    blocks = model.parallel_info()["blocks"]
    chosen = apply_activation_checkpointing(model, blocks, mode, every)
    assert [n for n, _ in model.named_parameters()] == names_before
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return chosen, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode, every, expected", [("full", 1, 2), ("selective", 1, 2), ("full", 2, 1)])
def test_checkpointing_keeps_loss_and_gradients(mode, every, expected):
    _, ref_loss, ref = _grads("none")
    chosen, loss, grads = _grads(mode, every)
    assert len(chosen) == expected
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
