"""optimizer.state_dtype = bf16: plait's AdamW with bf16 moments and layout-invariant stochastic
rounding (adamw_bf16.py, stochastic_round.py), and the refusal of int8."""

import math

import pytest
import torch

from plait.trainer.adamw_bf16 import AdamWBF16
from plait.trainer.config import Config, ConfigError
from plait.trainer.optimizer import build_optimizer, check_state_dtype
from plait.trainer.stochastic_round import global_index, key_of, random_bits, round_to_bf16

M32 = 0xFFFFFFFF


def fmix32(h: int) -> int:
    """MurmurHash3's finalizer in Python integers: the model the tensor hash must equal bit for bit."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_hash_equals_murmur_finalizer_bit_for_bit():
    """The int32 kernels wrap as the hash assumes (products past 2**31, negative keys)."""
    index = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 987654321], dtype=torch.int32)
    for seed, step, name in ((0, 1, "layers.0.attention.wq.weight"), (7, 300, "output.weight")):
        key = key_of(seed, step, name)
        low, high = random_bits(index, key)
        for i, (lo, hi) in zip(index.tolist(), zip(low.tolist(), high.tolist())):
            h = fmix32((i ^ key) & M32)
            assert (lo, hi) == (h & 0xFFFF, h >> 16), (i, key)
    # A parameter past 2**31 elements indexes in int64: its high word is mixed in.
    big = torch.tensor([5, 2**32 + 5], dtype=torch.int64)
    low, _ = random_bits(big, key_of(0, 1, "w"))
    assert low[0] != low[1]


def test_stochastic_rounding_is_unbiased():
    """x a third of a bf16 step above a bf16 value: rounded up a third of the time, mean x."""
    ulp = 2.0**-7  # bf16's step in [1, 2)
    for sign in (1.0, -1.0):
        x = sign * (1.0 + ulp / 3)
        n = 2**16
        bits, _ = random_bits(torch.arange(n, dtype=torch.int32), key_of(0, 1, "p"))
        rounded = round_to_bf16(torch.full((n,), x), bits).float()
        assert set(rounded.abs().unique().tolist()) == {1.0, 1.0 + ulp}
        # sigma of the mean: ulp * sqrt(p (1 - p) / n) with p = 1/3; 5 sigma
        assert abs(rounded.double().mean().item() - x) < 5 * ulp * math.sqrt(2 / 9 / n)
        assert torch.tensor(x).bfloat16().float().item() == sign * 1.0  # round-to-nearest loses it all
    # Values bf16 holds exactly are kept whatever the bits.
    exact = torch.tensor([0.0, -0.0, 1.5, -3.0, 2.0**-100])
    assert torch.equal(round_to_bf16(exact, torch.full((5,), 0xFFFF, dtype=torch.int32)).float(), exact)


def test_global_index_of_shards_tiles_the_parameter():
    """Row shards (FSDP's uneven chunks), column shards (TP) and pieces of rows (the optimizer's
    chunks): each element gets its index in the whole parameter."""
    whole = torch.arange(5 * 6, dtype=torch.int32).view(5, 6)
    boxes = [((3, 6), (0, 0)), ((2, 6), (3, 0)), ((5, 4), (0, 0)), ((5, 2), (0, 4)), ((2, 3), (3, 3))]
    for shape, offset in boxes:
        box = (shape, offset, (5, 6))
        expected = whole[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
        assert torch.equal(global_index(box, slice(0, shape[0]), torch.device("cpu")), expected)
        assert torch.equal(global_index(box, slice(1, 2), torch.device("cpu")), expected[1:2])
    assert global_index(((4,), (0,), (2**31,)), slice(0, 4), torch.device("cpu")).dtype == torch.int64


def _pair(steps: int, lr: float, seed: int = 0):
    """bf16-state AdamW and torch's fp32 AdamW from the same weights, stepped on the same gradients."""
    torch.manual_seed(seed)
    shapes = [(64, 33), (7,), ()]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a = AdamWBF16([(f"p{i}", p) for i, p in enumerate(ours)], seed=0, **kw)
    b = torch.optim.AdamW(ref, foreach=True, **kw)
    for _ in range(steps):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p) * (1 + p.detach().abs())
            q.grad = p.grad.clone()
        a.step()
        b.step()
    return a, ours, ref


def test_bf16_moments_follow_fp32_adamw():
    """Over N steps the weights stay within lr * N * 2**-6 of fp32 AdamW's: each update's
    direction m / sqrt(v) is off by a few bf16 rounding errors (2**-8 relative) of an update of
    size ~lr, and stochastic rounding makes those errors cancel rather than add (measured 2026-11-29: 2.3e-3, 7x under)."""
    steps, lr = 100, 1e-2
    a, ours, ref = _pair(steps, lr)
    worst = max((p - q).abs().max().item() for p, q in zip(ours, ref))
    assert 0 < worst <= lr * steps * 2**-6, worst
    state = a.state[ours[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert float(state["step"]) == steps


def test_bf16_state_is_12_bytes_per_parameter():
    """fp32 weight 4 + fp32 gradient 4 + two bf16 moments 4 (the step counts are one scalar per tensor)."""
    a, ours, _ = _pair(1, 1e-3)
    numel = sum(p.numel() for p in ours)
    moments = sum(v.numel() * v.element_size() for s in a.state.values() for k, v in s.items() if k != "step")
    weights_and_grads = sum(p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size() for p in ours)
    assert (weights_and_grads + moments) / numel == 12


def test_state_dtype_selects_the_optimizer_and_int8_is_refused():
    model = torch.nn.Linear(4, 4)
    config = Config()
    assert type(build_optimizer(model, config.optimizer, torch.device("cpu"))) is torch.optim.AdamW
    config.optimizer.state_dtype = "bf16"
    check_state_dtype(config.optimizer)
    opt = build_optimizer(model, config.optimizer, torch.device("cpu"), seed=3)
    assert isinstance(opt, AdamWBF16) and opt.seed == 3 and set(opt.names.values()) == {"weight", "bias"}
    config.optimizer.state_dtype = "int8"
    with pytest.raises(ConfigError) as e:
        check_state_dtype(config.optimizer)
    assert "\n" not in str(e.value) and "--optimizer.state_dtype bf16" in str(e.value)


def test_state_dict_round_trip_keeps_bf16_moments_and_steps():
    """torch's load_state_dict casts states to the parameter's fp32: they come back bf16, bit-equal,
    and the next step continues the same (the step count, read once on load, keys the rounding)."""
    a, ours, _ = _pair(3, 1e-2)
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in a.state[ours[0]].items()}
    b = AdamWBF16([(f"p{i}", p) for i, p in enumerate(ours)], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                  weight_decay=0.1, seed=0)  # fmt: skip
    b.load_state_dict(a.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert b.state[ours[0]][key].dtype == torch.bfloat16
        assert torch.equal(b.state[ours[0]][key], saved[key])
    start = [p.detach().clone() for p in ours]
    grads = [p.grad.clone() for p in ours]
    a.step()
    after_a = [p.detach().clone() for p in ours]
    with torch.no_grad():
        for p, s, g in zip(ours, start, grads):
            p.copy_(s)
            p.grad = g
    b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, after_a))
