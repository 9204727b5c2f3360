"""Grouped experts, router, load balancing and the MoE block against straightforward references."""

import pytest
import torch
import torch.nn.functional as F

from plait.models.moe import (
    GroupedExperts,
    MoE,
    TokenChoiceTopKRouter,
    moe_aux_loss,
    update_moe_load_balance,
)

DIM, HIDDEN, E = 32, 48, 6


def _experts(use_grouped_mm: bool, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(DIM, HIDDEN, E, use_grouped_mm=use_grouped_mm)
    experts.init_weights(0.02)
    with torch.no_grad():  # larger weights so differences are not hidden in tiny outputs
        for w in experts.parameters():
            w.mul_(20)
    return experts


def _run(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor):
    x = x.clone().requires_grad_()
    y = experts(x, counts)
    y.backward(torch.ones_like(y) * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype))
    grads = [w.grad.clone() for w in experts.parameters()]
    experts.zero_grad()
    return y, x.grad, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_mm_matches_loop(dtype, tol):
    counts = torch.tensor([5, 0, 9, 1, 0, 17])  # includes empty experts
    x = torch.randn(int(counts.sum()), DIM, dtype=dtype)
    loop, grouped = _experts(False).to(dtype), _experts(True).to(dtype)
    y_ref, gx_ref, gw_ref = _run(loop, x, counts)
    y, gx, gw = _run(grouped, x, counts)
    for got, ref in [(y, y_ref), (gx, gx_ref), *zip(gw, gw_ref)]:
        scale = float(ref.detach().float().abs().max())
        assert scale > 0.1
        torch.testing.assert_close(got.detach().float(), ref.detach().float(), atol=tol * scale, rtol=tol)


def test_grouped_mm_under_autocast_computes_in_the_autocast_dtype():
    """Autocast has no rule for grouped_mm: the experts cast like a matmul (bf16 out, fp32 grads)."""
    counts = torch.tensor([5, 0, 9, 1, 0, 17])
    x = torch.randn(int(counts.sum()), DIM)
    experts = _experts(True)
    y_ref, gx_ref, gw_ref = _run(_experts(True), x, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, gx, gw = _run(experts, x, counts)
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in gw)
    for got, ref in [(y, y_ref), (gx, gx_ref), *zip(gw, gw_ref)]:
        scale = float(ref.detach().abs().max())
        torch.testing.assert_close(got.detach().float(), ref.detach(), atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_experts_compile(dtype):
    """torch.compile of the experts, one graph in both dtypes: bf16 through torch._grouped_mm, fp32
    (which torch's fake-tensor rule for grouped_mm refuses) through plait::grouped_mm."""
    counts = torch.tensor([5, 0, 9, 1, 0, 17])
    x = torch.randn(int(counts.sum()), DIM, dtype=dtype)
    experts = _experts(True).to(dtype)
    y_ref, gx_ref, gw_ref = _run(experts, x, counts)
    compiled = torch.compile(experts, fullgraph=True)
    y, gx, gw = _run(compiled, x, counts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y_ref, atol=tol * float(y_ref.abs().max()), rtol=tol)
    for got, ref in [(gx, gx_ref), *zip(gw, gw_ref)]:
        torch.testing.assert_close(got, ref, atol=tol * float(ref.abs().max()), rtol=tol)


def test_rows_past_the_groups_are_zero_and_get_no_gradient():
    counts = torch.tensor([3, 0, 4, 1, 0, 2])  # 10 rows used of 16
    x = torch.randn(16, DIM)
    for use_grouped_mm in (False, True):
        y, gx, _ = _run(_experts(use_grouped_mm), x, counts)
        assert torch.all(y[10:] == 0) and torch.all(gx[10:] == 0)


def test_dtensor_like_weights_are_unwrapped():
    class FakeDTensor(torch.nn.Parameter):
        def to_local(self):
            return self.data * 1.0

    experts = _experts(True)
    counts = torch.tensor([2, 2, 2, 2, 2, 2])
    x = torch.randn(12, DIM)
    y_ref = experts(x, counts)
    for name in ("w1", "w2", "w3"):
        setattr(experts, name, FakeDTensor(getattr(experts, name).detach()))
    torch.testing.assert_close(experts(x, counts), y_ref)


def test_grouped_mm_needs_no_host_sync():
    # Meta tensors have no data: anything reading counts on the host would raise.
    experts = GroupedExperts(DIM, HIDDEN, E).to(device="meta", dtype=torch.bfloat16)
    x = torch.empty(40, DIM, device="meta", dtype=torch.bfloat16)
    assert experts(x, torch.empty(E, dtype=torch.int64, device="meta")).shape == (40, DIM)


def _router(**kw) -> TokenChoiceTopKRouter:
    torch.manual_seed(0)
    kw = {"dim": DIM, "num_experts": 8, "top_k": 2, **kw}
    router = TokenChoiceTopKRouter(**kw)
    router.init_weights(0.5)
    return router


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_scores_and_counts(score_func):
    router = _router(score_func=score_func, route_norm=True, route_scale=2.5)
    x = torch.randn(20, DIM)
    top_scores, selected, counts = router(x)
    logits = x @ router.gate.weight.t()
    scores = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
    expected_scores, expected_selected = scores.topk(2, dim=-1)
    assert torch.equal(selected, expected_selected)
    torch.testing.assert_close(top_scores, expected_scores / expected_scores.sum(-1, keepdim=True) * 2.5)
    assert torch.equal(counts, torch.bincount(selected.flatten(), minlength=8))
    assert torch.equal(router.tokens_per_expert, counts.float())
    # Evaluation forwards route the same way but never count into the load-balance statistics.
    router.eval()
    _, selected_eval, counts_eval = router(x)
    assert torch.equal(selected_eval, selected) and torch.equal(counts_eval, counts)
    assert torch.equal(router.tokens_per_expert, counts.float())


def test_expert_bias_changes_selection_not_weights():
    router = _router(score_func="sigmoid")
    x = torch.randn(20, DIM)
    scores = (x @ router.gate.weight.t()).sigmoid()
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, 10.0]))  # expert 7 always wins
    top_scores, selected, _ = router(x)
    assert torch.all(selected[:, 0] == 7)
    # The weight of the forced choice is its plain score: the bias never enters the weights.
    torch.testing.assert_close(top_scores, scores.gather(1, selected))
    top_scores.sum().backward()
    assert router.expert_bias.grad is None and router.gate.weight.grad is not None


def test_group_limited_routing_stays_in_best_groups():
    router = _router(score_func="sigmoid", n_groups=4, topk_groups=1, top_k=2)
    x = torch.randn(50, DIM)
    _, selected, _ = router(x)
    # With one allowed group of 2 experts, both picks of a token share a group.
    assert torch.equal(selected[:, 0] // 2, selected[:, 1] // 2)
    scores = (x @ router.gate.weight.t()).sigmoid().view(50, 4, 2)
    best_group = scores.sum(-1).argmax(-1)  # top-2 of 2 == the group's sum
    assert torch.equal(selected[:, 0] // 2, best_group)


def test_bias_update_direction_and_reset():
    router = _router()
    with torch.no_grad():
        router.tokens_per_expert.copy_(torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5]))
    router.update_expert_bias(0.1)
    bias = router.expert_bias
    assert bias[0] < 0 < bias[1]  # over-loaded expert down, starved expert up
    assert abs(float(bias.sum())) < 1e-6  # centred
    assert torch.all(router.tokens_per_expert == 0)


def _moe(**router_kw) -> MoE:
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(DIM, E, top_k=2, **router_kw)
    moe = MoE(DIM, HIDDEN, E, num_shared_experts=1, router=router)
    moe.init_weights(0.02)
    return moe


def test_load_balance_accumulation_equals_one_big_batch():
    x = torch.randn(4, 8, DIM)
    big, micro = _moe(), _moe()
    big(x)
    micro(x[:2])
    micro(x[2:])
    update_moe_load_balance(big, 1e-2)
    update_moe_load_balance(micro, 1e-2)
    assert torch.any(big.router.expert_bias != 0)
    torch.testing.assert_close(micro.router.expert_bias, big.router.expert_bias)


def test_load_balance_of_a_model_is_each_routers_own_update_to_the_bit():
    torch.manual_seed(0)
    layers = [torch.nn.ModuleList([_moe() for _ in range(3)]) for _ in range(2)]
    for i in range(3):
        counts = torch.randint(0, 50, (E,)).float()
        counts[: i + 1] = counts[0]  # ties too
        for model in layers:
            model[i].router.tokens_per_expert.copy_(counts)
    update_moe_load_balance(layers[0], 1e-3)
    for moe in layers[1]:
        moe.router.update_expert_bias(1e-3)
    for one, own in zip(layers[0], layers[1]):
        assert torch.equal(one.router.expert_bias, own.router.expert_bias)
        assert torch.any(one.router.expert_bias != 0) and torch.all(one.router.tokens_per_expert == 0)


def test_load_balance_reduce_counts_sees_all_layers_at_once():
    model = torch.nn.ModuleList([_moe(), _moe()])
    seen = []
    model[0](torch.randn(1, 4, DIM))
    update_moe_load_balance(model, 1e-2, reduce_counts=lambda counts: seen.append(counts.shape))
    assert seen == [torch.Size([2, E])]


def test_moe_matches_per_token_reference():
    moe = _moe(score_func="softmax")
    x = torch.randn(2, 5, DIM)
    y = moe(x)
    x_TD = x.view(-1, DIM)
    top_scores, selected, _ = moe.router(x_TD)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    expected = moe.shared_experts(x_TD).clone()
    for t in range(x_TD.shape[0]):
        for k in range(2):
            e = selected[t, k]
            h = F.silu(x_TD[t] @ w1[e]) * (x_TD[t] @ w3[e])
            expected[t] += top_scores[t, k] * (h @ w2[e])
    torch.testing.assert_close(y.view(-1, DIM), expected, atol=1e-5, rtol=1e-5)


def test_sequence_aux_loss_is_opt_in_and_trains_through_the_output():
    """Off by default; on, each training forward ties it into the output (its value detached on
    the router), so the output's backward alone gives the gate its gradient. Exactness, activation
    checkpointing and context parallel: test_moe_aux_loss.py."""
    moe = _moe(score_func="sigmoid")
    moe(torch.randn(2, 4, DIM))
    assert moe_aux_loss(moe) == 0.0
    moe = _moe(score_func="sigmoid", aux_loss_coeff=0.1)
    (moe(torch.randn(2, 4, DIM)) * 0).sum().backward()  # a zero output gradient: the aux loss's alone
    value = moe_aux_loss(moe)
    assert value.item() > 0 and not value.requires_grad
    assert moe.router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_shared_experts_run_before_the_routed_output_is_first_used(deterministic):
    # Expert parallel's combine hands back its all-to-all's output un-waited (an
    # AsyncCollectiveTensor waits at first use): the shared experts must run before that use to
    # overlap with it. Stand in for the collective with an AsyncCollectiveTensor of the output.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    moe = _moe()
    outputs, seen = [], []
    moe.experts.register_forward_hook(lambda m, args, y: outputs.append(AsyncCollectiveTensor(y)) or outputs[-1])
    moe.shared_experts.register_forward_pre_hook(lambda m, args: seen.append(outputs[-1].completed))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        x = torch.randn(2, 5, DIM)
        y = moe(x)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert seen == [False] and outputs[-1].completed  # not waited when the shared experts start; used after
    torch.testing.assert_close(y, _moe()(x))  # the wrapper changes nothing
