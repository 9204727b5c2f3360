"""bf16 products on a CPU that emulates bf16 (plait.models.cpu_bf16): `Linear`, `bmm` and the
experts' grouped GEMM run fp32 kernels on the bf16 operands, forward and backward, round once to
bf16 and save the bf16 operands; on a CPU with bf16 units they are torch's own ops, bitwise. Both
branches run on any CPU: the tests set `CPU_BF16_UNITS`."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from plait.models import cpu_bf16
from plait.models.deepseek_v3 import FLAVORS
from plait.models.deepseek_v3.model import Transformer
from plait.models.moe.grouped_mm_op import grouped_mm

BF16_ULP = 2.0**-8  # relative spacing of bf16 at the top of a binade


def _leaves(*shapes, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _linear(x, w, b):
    return cpu_bf16.linear(x, w, b)


def _bmm(a, b):
    return cpu_bf16.bmm(a, b)


OFFS = torch.tensor([8, 8, 32], dtype=torch.int32)  # with an empty group


def _grouped(a, b):
    return grouped_mm(a, b, OFFS)


# name -> (plait op, torch's op, operand shapes)
OPS = {
    "linear": (_linear, F.linear, [(2, 24, 32), (48, 32), (48,)]),
    "linear_no_bias": (lambda x, w: cpu_bf16.linear(x, w), F.linear, [(2, 24, 32), (48, 32)]),
    "bmm": (_bmm, torch.bmm, [(3, 24, 32), (3, 32, 48)]),
    "grouped_mm": (_grouped, lambda a, b: torch._grouped_mm(a, b, offs=OFFS), [(32, 32), (3, 32, 48)]),
}


def _forward_backward(op, leaves):
    y = op(*leaves)
    g = torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype)
    return [y.detach(), *torch.autograd.grad(y, leaves, g)]


def _kernel_input_dtypes(fn) -> set[str]:
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    kernels = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm")
    return {e.input_dtypes[0] for e in prof.events() if e.name in kernels}


@pytest.mark.parametrize("name", OPS)
def test_without_bf16_units_products_run_fp32_kernels_and_round_once(name, monkeypatch):
    """Outputs and gradients are the fp32 product of the bf16 operands rounded once to bf16 (to one
    bf16 ulp: fp32 sums in another order), the kernels see fp32, autograd keeps bf16 operands."""
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", False)
    op, torch_op, shapes = OPS[name]
    leaves = _leaves(*shapes)
    saved_dtypes = []

    def pack(t):
        saved_dtypes.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _forward_backward(op, leaves)
    fp32_leaves = [t.detach().float().requires_grad_() for t in leaves]
    want = _forward_backward(torch_op, fp32_leaves)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.bfloat16().float(), rtol=2 * BF16_ULP, atol=BF16_ULP * float(b.abs().max()))
    assert set(saved_dtypes) <= {torch.bfloat16, torch.int32} and torch.bfloat16 in saved_dtypes
    assert _kernel_input_dtypes(lambda: _forward_backward(op, leaves)) == {"float"}


@pytest.mark.parametrize("name", OPS)
def test_with_bf16_units_products_are_torchs_own_bitwise(name, monkeypatch):
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", True)
    op, torch_op, shapes = OPS[name]
    leaves = _leaves(*shapes)
    for a, b in zip(_forward_backward(op, leaves), _forward_backward(torch_op, leaves), strict=True):
        assert torch.equal(a, b)
    assert _kernel_input_dtypes(lambda: _forward_backward(op, leaves)) == {"c10::BFloat16"}


@pytest.mark.parametrize("bf16_units", [True, False])
def test_linear_under_autocast_casts_as_autocast_does(bf16_units, monkeypatch):
    """fp32 weights and input under CPU bf16 autocast (the one-process and TP-alone runs): a bf16
    output and fp32 gradients, as autocast's own linear gives, on either branch."""
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", bf16_units)
    layer = cpu_bf16.Linear(32, 48)
    x = torch.randn(2, 24, 32, requires_grad=True)
    results = []
    for fn in (layer, lambda t: F.linear(t, layer.weight, layer.bias)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x)
        results.append([y.detach(), *torch.autograd.grad(y.float().square().sum(), (x, layer.weight, layer.bias))])
    (y, *grads), (y_ref, *grads_ref) = results
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
    for a, b in zip([y, *grads], [y_ref, *grads_ref]):
        torch.testing.assert_close(a.float(), b.float(), rtol=4 * BF16_ULP, atol=4 * BF16_ULP * float(b.abs().max()))


def _tiny_deepseek():
    args = dataclasses.replace(
        FLAVORS["debugmodel"], vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_heads=2,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_seq_len=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(buffer_device="cpu")
    return model.to(torch.bfloat16)


def _step(model, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n.replace("_orig_mod.", ""): p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_deepseek_v3_bf16_step_through_fp32_kernels_matches_the_bf16_kernels(monkeypatch):
    """The whole bf16 model (MLA, dense FFN, router, grouped experts, output head) on both
    branches: the same loss and gradients to bf16 precision; compiled (fullgraph, no break) too."""
    model = _tiny_deepseek()
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", True)
    loss_ref, grads_ref = _step(model, tokens)
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", False)
    assert _kernel_input_dtypes(lambda: _step(model, tokens)) == {"float"}
    runs = [_step(model, tokens)]
    torch._dynamo.reset()
    block = model.layers["1"]  # attention + MoE
    model.layers["1"] = torch.compile(block, fullgraph=True, backend="aot_eager")  # a graph break raises
    runs.append(_step(model, tokens))
    model.layers["1"] = block
    for loss, grads in runs:
        torch.testing.assert_close(loss, loss_ref, rtol=1e-2, atol=0)
        assert set(grads) == set(grads_ref) and len(grads) > 10
        for key, want in grads_ref.items():
            # bf16 activations: a one-ulp difference early moves later values by a few ulps.
            torch.testing.assert_close(grads[key], want, rtol=0.05, atol=0.05 * float(want.abs().max()), msg=key)


@pytest.mark.parametrize("name", OPS)
def test_gpu_route_takes_torchs_bf16_kernels_without_bf16_units(name, monkeypatch):
    """Under gpu_route (what plait-plan traces for a GPU) a CPU without bf16 units runs torch's own
    bf16 products, bitwise, as a CPU with them does; the route ends with the block."""
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", False)
    op, torch_op, shapes = OPS[name]
    leaves = _leaves(*shapes)
    with cpu_bf16.gpu_route():
        assert not cpu_bf16.cpu_multiplies_in_fp32(torch.bfloat16) and not cpu_bf16.cpu_attends_in_fp32(16)
        for a, b in zip(_forward_backward(op, leaves), _forward_backward(torch_op, leaves), strict=True):
            assert torch.equal(a, b)
        assert _kernel_input_dtypes(lambda: _forward_backward(op, leaves)) == {"c10::BFloat16"}
    assert not cpu_bf16.GPU_ROUTE and cpu_bf16.cpu_multiplies_in_fp32(torch.bfloat16)


def _ops_of(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        fn()
    return names


@pytest.mark.parametrize("bf16_units", [True, False])
def test_gpu_route_traces_mla_attention_without_padded_values(bf16_units, monkeypatch):
    """MLA (values narrower than queries) traced with fake tensors under gpu_route: SDPA's
    memory-efficient kernel on the unpadded values, as a GPU runs it (no CPU flash on padded values,
    no fp32 copies); real tensors under the route still take a CPU kernel (bf16 flash on padded values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from plait.models.common import causal_attention

    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", bf16_units)
    shapes = [(2, 4, 64, 24), (2, 4, 64, 24), (2, 4, 64, 16)]
    with cpu_bf16.gpu_route():
        with FakeTensorMode():
            q, k, v = (torch.empty(s, dtype=torch.bfloat16, requires_grad=True) for s in shapes)
            ops = _ops_of(lambda: causal_attention(q, k, v, None).sum().backward())
            out = causal_attention(q, k, v, None)
        assert out.shape == (2, 4, 64, 16) and out.dtype == torch.bfloat16
        assert "_scaled_dot_product_efficient_attention.default" in ops
        assert not any(op.startswith(("constant_pad_nd", "_to_copy", "_scaled_dot_product_flash")) for op in ops)
        q, k, v = _leaves(*shapes)
        routed = causal_attention(q, k, v, None)
    torch.testing.assert_close(routed, causal_attention(q, k, v, None), rtol=4 * BF16_ULP, atol=4 * BF16_ULP)


@pytest.mark.parametrize("units", [True, False])
def test_one_route_switch(units, monkeypatch):
    """training.cpu_bf16 (issue 40 item 2): auto follows the CPU, native never takes the fp32
    kernels, fp32 always does; fp64 and GPUs are never touched; the route is a checked name."""
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", units)
    monkeypatch.setattr(cpu_bf16, "ROUTE", "auto")
    assert cpu_bf16.cpu_multiplies_in_fp32(torch.bfloat16) is (not units)
    assert cpu_bf16.cpu_attends_in_fp32(32) is (not units) and cpu_bf16.cpu_attends_in_fp32(16)
    cpu_bf16.set_route("native")
    assert not cpu_bf16.cpu_multiplies_in_fp32(torch.bfloat16) and not cpu_bf16.cpu_attends_in_fp32(16)
    cpu_bf16.set_route("fp32")
    assert cpu_bf16.cpu_multiplies_in_fp32(torch.bfloat16) and cpu_bf16.cpu_attends_in_fp32(128)
    assert not cpu_bf16.cpu_multiplies_in_fp32(torch.float64) and not cpu_bf16.cpu_multiplies_in_fp32(torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="use one of auto, native, fp32"):
        cpu_bf16.set_route("fast")


def test_arm_bf16_is_detected(monkeypatch, tmp_path):
    """An ARM CPU with the BF16 extension (cpuinfo's `bf16` feature) counts as having bf16 units."""
    import builtins
    import platform

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm\n")
    real_open = builtins.open
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(cpuinfo if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert cpu_bf16._has_bf16_units()
    cpuinfo.write_text("Features\t: fp asimd evtstrm aes\n")
    assert not cpu_bf16._has_bf16_units()


def test_fp64_attention_stays_fp64():
    """fp64 is not low precision: causal attention keeps it (it was attended in fp32)."""
    from plait.models.common import causal_attention

    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    out = causal_attention(q, k, v, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.float64 and torch.equal(out, ref)
