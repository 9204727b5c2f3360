"""The MoE step compiles whole: a DeepSeek-V3 MoE block and transformer block under
`torch.compile(fullgraph=True)` in fp32 (grouped_mm through the `plait::grouped_mm` custom op) match
eager, forward and gradients; the custom op's gradients are torch's; and the equal-groups path
(capacity mode's `group_rows`, one batched matmul) matches the grouped_mm path.

aot_eager: dynamo's tracing (no graph break, else fullgraph raises), the fake rules and the traced
backward, without inductor's C++ build (seconds instead of tens of seconds on a shared CPU).
"""


import dataclasses

import pytest
import torch

from plait.models import cpu_bf16
from plait.models.deepseek_v3 import ModelArgs
from plait.models.deepseek_v3.model import TransformerBlock, build_moe
from plait.models.deepseek_v3.rope import rope_tables
from plait.models.llama3.rope import rope_at
from plait.models.moe import GroupedExperts, configure_moe_aux_loss, moe_aux_loss
from plait.models.moe.grouped_mm_op import grouped_mm

ARGS = ModelArgs(
    vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=2, n_heads=2, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_seq_len=16, original_seq_len=16,
    n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
)


def _grads(module, *inputs):
    """Forward, a loss that weights every output element differently, backward: (y, input and
    parameter gradients)."""
    x = inputs[0].detach().clone().requires_grad_()
    y = module(x, *inputs[1:])
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    return y.detach(), grads


def _assert_close(got, ref, tol=1e-5):
    assert len(got[1]) == len(ref[1]) and len(ref[1]) > 3
    for a, b in zip([got[0], *got[1]], [ref[0], *ref[1]]):
        torch.testing.assert_close(a, b, atol=tol * float(b.abs().max()), rtol=tol)


def test_deepseek_moe_and_transformer_blocks_compile_fullgraph_in_fp32_and_match_eager():
    torch.manual_seed(0)
    moe = build_moe(ARGS)
    moe.init_weights(0.1)
    block = TransformerBlock(1, ARGS)  # layer 1 >= n_dense_layers: attention + MoE
    block.init_weights()
    cos, sin = rope_at(*rope_tables(ARGS), torch.arange(8))
    x = torch.randn(2, 8, ARGS.dim)
    for module, extra in ((moe, ()), (block, (cos, sin))):
        ref = _grads(module, x, *extra)
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")  # a graph break raises
        _assert_close(_grads(compiled, x, *extra), ref)


def test_moe_with_the_aux_loss_compiles_fullgraph_and_matches_eager():
    """The aux loss's tie into the router's output (an autograd Function) and a count sum over
    context-parallel ranks (a callable the trainer installs; here a stand-in for 2 ranks holding
    equal halves) compile without a graph break; the loss's value and the gradients are eager's."""
    torch.manual_seed(0)
    moe = build_moe(dataclasses.replace(ARGS, aux_loss_coeff=0.1))
    moe.init_weights(0.1)
    configure_moe_aux_loss(moe, grad_scale=0.5, sequence_parts=2, reduce_counts=lambda counts_BE: counts_BE * 2)
    x = torch.randn(2, 8, ARGS.dim)
    ref, ref_value = _grads(moe, x), moe_aux_loss(moe)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    _assert_close(_grads(compiled, x), ref)
    torch.testing.assert_close(moe_aux_loss(moe), ref_value)
    assert ref_value > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_op_gradients_are_torch_grouped_mm_gradients(dtype, monkeypatch):
    # torch's kernel itself; on a CPU that emulates bf16 the op multiplies in fp32 (test_cpu_bf16.py).
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", True)
    a = torch.randn(40, 16, dtype=dtype, requires_grad=True)
    b = torch.randn(3, 16, 24, dtype=dtype, requires_grad=True)
    offs = torch.tensor([8, 8, 32], dtype=torch.int32)  # an empty group; rows 32.. outside every group
    g = torch.randn(40, 24, dtype=dtype)
    y_ref = torch._grouped_mm(a, b, offs=offs)
    ga_ref, gb_ref = torch.autograd.grad(y_ref, (a, b), g)
    y = grouped_mm(a, b, offs)
    ga, gb = torch.autograd.grad(y, (a, b), g)
    assert torch.equal(y[:32], y_ref[:32]) and torch.equal(ga[:32], ga_ref[:32]) and torch.equal(gb, gb_ref)


class _EqualGroups(torch.nn.Module):
    """Calls the experts as capacity-mode expert parallel does: with `group_rows`."""

    def __init__(self, experts: GroupedExperts, group_rows: int):
        super().__init__()
        self.experts, self.group_rows = experts, group_rows

    def forward(self, x_ND, counts_E):
        return self.experts(x_ND, counts_E, group_rows=self.group_rows)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_equal_groups_batched_matmul_matches_grouped_mm(dtype, tol):
    """Capacity mode's layout: 4 experts x 16 rows each, unused slots of a group zero rows."""
    torch.manual_seed(0)
    experts = GroupedExperts(32, 48, 4).to(dtype)
    experts.init_weights(0.5)
    experts.pad_groups = False  # as expert parallel sets it: the groups arrive aligned
    x = torch.randn(4, 16, 32, dtype=dtype)
    x[:, 11:] = 0
    x, counts = x.view(64, 32), torch.full((4,), 16)
    ref = _grads(experts, x, counts)
    got = _grads(_EqualGroups(experts, 16), x, counts)
    assert got[0].dtype == dtype and torch.all(got[0].view(4, 16, 32)[:, 11:] == 0)
    _assert_close(got, ref, tol)
    torch._dynamo.reset()
    compiled = torch.compile(_EqualGroups(experts, 16), fullgraph=True, backend="aot_eager")
    _assert_close(_grads(compiled, x, counts), ref, tol)
