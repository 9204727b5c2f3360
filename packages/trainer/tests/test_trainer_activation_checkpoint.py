"""Activation checkpointing changes memory, not math: same loss and gradients, same module paths.

And it does change memory: checkpointed blocks run their forward again in backward, and the bytes
a forward leaves alive for backward order as none > selective > full.
"""

import functools
import gc
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.models import build_model
from plait.trainer.activation_checkpoint import apply_activation_checkpointing

BLOCK_PARTS = ("attention_norm", "attention", "attention.sdpa", "ffn_norm", "feed_forward")
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _model():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model("llama3", "debugmodel", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _loss(model):
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _grads(mode: str, every: int = 1):
    model = _model()
    names_before = [n for n, _ in model.named_parameters()]
    blocks = model.parallel_info()["blocks"]
    chosen = apply_activation_checkpointing(model, blocks, mode, every)
    assert [n for n, _ in model.named_parameters()] == names_before
    loss = _loss(model)
    loss.backward()
    return chosen, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@functools.cache
def _reference():
    return _grads("none")


@pytest.mark.parametrize("mode, every, expected", [("full", 1, 2), ("selective", 1, 2), ("full", 2, 1)])
def test_checkpointing_keeps_loss_and_gradients(mode, every, expected):
    _, ref_loss, ref = _reference()
    chosen, loss, grads = _grads(mode, every)
    assert len(chosen) == expected
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


class _Ops(TorchDispatchMode):
    """Counts matmuls, and keeps a weak reference to the storage of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0
        self.storages = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in MATMULS
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.append((weakref.ref(storage), storage.data_ptr(), storage.nbytes()))
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        """Bytes of the storages made so far that are still alive, except those at `exclude` pointers."""
        gc.collect()
        alive = {ptr: n for ref, ptr, n in self.storages if ref() is not None and ptr not in exclude}
        return sum(alive.values())


def _measure(mode: str, every: int):
    """Module calls and matmuls in forward and in backward, and the bytes forward leaves for backward."""
    model = _model()
    blocks = model.parallel_info()["blocks"]
    chosen = apply_activation_checkpointing(model, blocks, mode, every)
    phase = ["forward"]
    calls = Counter()
    for block in blocks:
        for part in BLOCK_PARTS:
            # A pre-hook: recomputation may stop early, once it has rebuilt every tensor backward needs.
            model.get_submodule(f"{block}.{part}").register_forward_pre_hook(
                lambda *_, key=(block, part): calls.update([(phase[0], key)])
            )
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    ops = _Ops()
    with ops:
        loss = _loss(model)
        saved = ops.live_bytes(exclude=weights)  # only `loss` is referenced here: the rest is the graph's
        forward_matmuls = ops.matmuls
        phase[0] = "backward"
        loss.backward()
    return chosen, calls, saved, forward_matmuls, ops.matmuls - forward_matmuls


@functools.cache
def _measured(mode: str, every: int):
    return _measure(mode, every)


@pytest.mark.parametrize("mode, every", [("none", 1), ("full", 1), ("selective", 1), ("full", 2), ("selective", 2)])
def test_checkpointed_blocks_rerun_their_forward_in_backward(mode, every):
    chosen, calls, _, _, _ = _measured(mode, every)
    blocks = [f"layers.{i}" for i in range(2)]
    assert chosen == ([] if mode == "none" else blocks[::every])
    for block in blocks:
        for part in BLOCK_PARTS:
            assert calls["forward", (block, part)] == 1, (block, part)
            assert calls["backward", (block, part)] == (block in chosen), (mode, block, part)


def test_selective_saves_less_than_none_and_more_than_full():
    _, _, none_bytes, none_fwd_mm, none_bwd_mm = _measured("none", 1)
    _, _, selective_bytes, selective_fwd_mm, selective_bwd_mm = _measured("selective", 1)
    _, _, full_bytes, full_fwd_mm, full_bwd_mm = _measured("full", 1)
    assert none_bytes > selective_bytes > full_bytes > 0, (none_bytes, selective_bytes, full_bytes)
    # Selective keeps the matmul outputs, so backward runs no more matmuls than without checkpointing;
    # full checkpointing runs each block's 7 matmuls again (wq, wk, wv, wo, w1, w3, w2), or 6 when
    # recomputation stops early, once it has rebuilt what backward needs (w2's output is not).
    assert none_fwd_mm == selective_fwd_mm == full_fwd_mm
    assert selective_bwd_mm == none_bwd_mm
    assert 2 * 6 <= full_bwd_mm - none_bwd_mm <= 2 * 7
