"""The chunked linear cross-entropy (chunked_loss.py) against F.cross_entropy on full logits:
loss and gradients of h and W, ignored labels, whole chunks ignored, token counts that chunks do
not divide, bf16 (autocast and the CPU's fp32-kernel route), and the vocab-parallel form on 2
ranks. torch.compile(fullgraph=True) of it, as plait-train compiles it:
test_trainer_chunked_loss_step.py::test_compiled_chunked_matches_full."""

import pytest
import torch
import torch.nn.functional as F

from plait.models import cpu_bf16
from plait.trainer.chunked_loss import IGNORE_INDEX, chunked_linear_cross_entropy
from plait.trainer.loss_head import chunk_tokens_for

B, S, D, V = 2, 37, 16, 96  # 74 tokens: chunks of 16 leave a remainder


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, 20:] = IGNORE_INDEX  # tokens 57..73 of the flattened rows: chunk 64..73 all ignored
    return h, w, labels


def _full(h, w, labels):
    """The unfused loss as plait-train computes it: logits, fp32 upcast, summed cross-entropy."""
    logits = F.linear(h, w)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk", [16, 5, 1000])
def test_matches_full_cross_entropy_fp32(chunk):
    h, w, labels = _inputs()
    ref = _full(h, w, labels)
    out = chunked_linear_cross_entropy(h, w, labels, chunk)
    assert out.shape == labels.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.flatten(), ref, rtol=1e-6, atol=1e-6)
    assert (out[labels == IGNORE_INDEX] == 0).all()
    # A per-token weighting (as MTP's depths get) reaches the right rows of both gradients.
    weights = torch.rand(B, S, generator=torch.Generator().manual_seed(1))
    for a, b in zip(_grads((ref * weights.flatten()).sum(), h, w), _grads((out * weights).sum(), h, w)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_all_ignored_gives_zero_loss_and_gradients():
    h, w, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    out = chunked_linear_cross_entropy(h, w, labels, 16)
    grad_h, grad_w = _grads(out.sum(), h, w)
    assert out.abs().sum() == 0 and grad_h.abs().sum() == 0 and grad_w.abs().sum() == 0


@pytest.mark.parametrize("route", ["native", "fp32"])
def test_bf16_autocast_matches_the_unfused_path(route, monkeypatch):
    """Under autocast (a one-rank bf16 run) the product is bf16 as the output linear's would be, the
    softmax in fp32; on the fp32-kernel route through plait's Linear, as the model computes it."""
    monkeypatch.setattr(cpu_bf16, "ROUTE", route)
    h, w, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(cpu_bf16.linear(h, w).flatten(0, 1).float(), labels.flatten(),
                              ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
        out = chunked_linear_cross_entropy(h, w, labels, 16).sum()
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=1e-3)
    for a, b in zip(_grads(ref, h, w), _grads(out, h, w)):
        assert b.dtype == torch.float32  # the fp32 leaves get fp32 gradients through autocast's casts
        # bf16 products summed per chunk, not in one product: the parity matrix's measure, per tensor.
        assert ((b - a).norm() / a.norm()).item() < 1e-2


def test_bf16_inputs_keep_their_dtype():
    h, w, labels = _inputs(torch.bfloat16)
    out = chunked_linear_cross_entropy(h, w, labels, 16)
    assert out.dtype == torch.float32
    grad_h, grad_w = _grads(out.sum(), h, w)
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    ref = _full(h.float(), w.float(), labels)
    torch.testing.assert_close(out.flatten(), ref, rtol=2e-2, atol=2e-2)


def test_mismatched_labels_are_refused():
    h, w, labels = _inputs()
    with pytest.raises(ValueError, match="one label per token"):
        chunked_linear_cross_entropy(h, w, labels[:, :-1], 16)


def test_automatic_chunk_is_sized_from_the_vocabulary():
    assert chunk_tokens_for(0, 128_256) == 512
    assert chunk_tokens_for(0, 2048) == 32768
    assert chunk_tokens_for(300, 128_256) == 300


def _vocab_parallel(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    h, w, labels = _inputs()
    labels[1, 3] = V - 1  # a target in the last rank's shard
    rows = V // world_size
    local_w = w.detach()[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    out = chunked_linear_cross_entropy(h, local_w, labels, 16, dist.group.WORLD, rank * rows)
    ref = _full(h, w, labels)
    torch.testing.assert_close(out.flatten(), ref, rtol=1e-6, atol=1e-6)
    grad_h, grad_local_w = _grads(out.sum(), h, local_w)
    dist.all_reduce(grad_h)  # each rank's vocabulary rows contribute a partial sum
    ref_h, ref_w = _grads(ref.sum(), h, w)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_local_w, ref_w[rank * rows : (rank + 1) * rows], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_vocab_parallel_two_ranks_matches_full_cross_entropy():
    from plait.testing import run_on_ranks

    run_on_ranks(_vocab_parallel, 2)
