"""bf16 optimizer states on 2 ranks: sharded parameters (DTensors as FSDP, TP and EP hold them,
uneven shards included) end with the same bits as the whole parameters stepped on one process,
weights and both moments, because each element rounds with its own index in the whole parameter."""

import pytest
import torch

from plait.testing import run_on_ranks

SHAPES = {"w_rows": (5, 6), "bias": (7,), "experts": (4, 3, 8)}
STEPS = 4


def _problem():
    """Weights and per-step gradients, the same on every rank (a fixed seed, CPU generator)."""
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) * 10 ** (-i) for n, s in SHAPES.items()} for i in range(STEPS)]
    return weights, grads


def _train(params: dict, grads: list, to_param_layout) -> "AdamWBF16":  # noqa: F821
    from plait.trainer.adamw_bf16 import AdamWBF16

    opt = AdamWBF16(list(params.items()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, seed=5)
    for step_grads in grads:
        for name, p in params.items():
            p.grad = to_param_layout(name, step_grads[name])
        opt.step()
    return opt


def _bits(opt, params: dict, full) -> dict:
    out = {}
    for name, p in params.items():
        state = opt.state[p]
        out[name] = [full(t).view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
                     for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"])]  # fmt: skip
    return out


def _sharded_rank(rank: int, world_size: int, dim_of: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    weights, grads = _problem()
    params = {n: torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(dim_of[n])])) for n, w in weights.items()}
    opt = _train(params, grads, lambda n, g: distribute_tensor(g, mesh, [Shard(dim_of[n])]))
    return _bits(opt, params, lambda t: t.full_tensor())


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "dim_of",
    [
        {"w_rows": 0, "bias": 0, "experts": 0},  # FSDP's dim-0 shards (5 rows: 3 + 2), EP's experts
        {"w_rows": 1, "bias": 0, "experts": 2},  # TP's column shards, inner dims
    ],
    ids=["dim0", "inner_dims"],
)
def test_sharded_steps_equal_one_process_bit_for_bit(dim_of):
    weights, grads = _problem()
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    expected = _bits(_train(params, grads, lambda n, g: g), params, lambda t: t)
    for rank_bits in run_on_ranks(_sharded_rank, 2, dim_of, timeout=150):
        for name, tensors in expected.items():
            for what, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), tensors, rank_bits[name]):
                assert torch.equal(a, b), (name, what)
