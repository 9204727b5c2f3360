"""Expert parallel on a MoE plait did not write (issue 26): the model, its router and its experts
are written here, the way a user writes them, and handed to `apply_expert_parallel` through the
adapters of `plait.expertparallel.adapter`:

(b) per-expert linears (`nn.ModuleList` of Mixtral-style SwiGLU MLPs) -> `StackedExperts`;
(a) weights already stacked `[E, in, out]` (the user's own module, `torch._grouped_mm`), converted
    from the same per-expert checkpoint.

Both train 3 AdamW steps (fp32) under EP 2 on 2 gloo ranks, each rank half the batch, against the
model *as its author wrote it* (a loop over its experts) on the whole batch in this process; so
does (b) with torch's own `fully_shard` over the non-expert part (FSDP 2 x EP 2, the experts left
to EP through `ignored_params`):
losses within 1e-5, every gradient within 1e-4 of the reference gradient's norm (the parity
matrix's tolerances), parameters within 1e-5, and `StackedExperts.unstack()` gives back the
per-expert modules with the trained weights. A module that lacks what expert parallel needs is
refused with one line naming it, before the mesh is used at all.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from plait.expertparallel import (
    StackedExperts,
    apply_expert_parallel,
    local,
    permute_and_pad,
    unpermute,
)
from plait.mesh import ParallelConfigError, ParallelDims, build_meshes
from plait.testing import run_on_ranks

E, K, D, H, V, S, LAYERS = 4, 2, 16, 32, 64, 8, 2
BATCH, STEPS, LR = 4, 3, 1e-3  # the global batch: 2 sequences per rank under EP 2


class MLP(nn.Module):
    """A Mixtral-style expert (also the shared expert): w2(silu(w1 x) * w3 x)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False), nn.Linear(D, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedSwiGLU(nn.Module):
    """Case (a): the user's experts with weights stacked [E, in, out], one grouped GEMM per weight."""

    permute_and_pad = staticmethod(permute_and_pad)  # the contract's reorder, from plait.expertparallel
    unpermute = staticmethod(unpermute)
    group_alignment = 4  # fp32 rows per 16 bytes: expert parallel pads every group to it

    def __init__(self, experts: nn.ModuleList):
        super().__init__()
        # The checkpoint conversion: nn.Linear keeps [out, in]; stacked weights are [E, in, out].
        for name in ("w1", "w2", "w3"):
            stacked = torch.stack([getattr(m, name).weight.detach().t() for m in experts])
            self.register_parameter(name, nn.Parameter(stacked))

    def forward(self, x_ND, num_tokens_per_expert_E):
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)  # the local experts under EP
        offsets_E = torch.cumsum(num_tokens_per_expert_E, 0, dtype=torch.int32)
        # grouped_mm leaves rows past the last group undefined: zero them (no host sync).
        valid_N1 = (torch.arange(x_ND.shape[0]) < offsets_E[-1])[:, None]
        x_ND = torch.where(valid_N1, x_ND, 0.0)
        h_NH = F.silu(torch._grouped_mm(x_ND, w1, offs=offsets_E)) * torch._grouped_mm(x_ND, w3, offs=offsets_E)
        return torch.where(valid_N1, torch._grouped_mm(h_NH, w2, offs=offsets_E), 0.0)


class MoE(nn.Module):
    """Router top-k -> experts -> weighted sum, plus a shared expert."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(E))
        self.shared = MLP()

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, D)
        top_scores_TK, top_experts_TK = torch.softmax(self.router(x_TD), dim=-1).topk(K, dim=-1)
        top_scores_TK = top_scores_TK / top_scores_TK.sum(-1, keepdim=True)
        if isinstance(self.experts, nn.ModuleList):
            # The model as its author wrote it: one expert at a time over the tokens that chose it.
            out_TD = torch.zeros_like(x_TD)
            for e, expert in enumerate(self.experts):
                token_M, choice_M = torch.where(top_experts_TK == e)
                out_TD.index_add_(0, token_M, expert(x_TD[token_M]) * top_scores_TK[token_M, choice_M, None])
        else:
            # The call site expert parallel hooks: (token, choice) pairs sorted by expert, with
            # the count of every expert, into experts(rows, counts) positionally; rows come back in
            # the same order.
            expert_N = top_experts_TK.flatten()
            order_N = torch.argsort(expert_N, stable=True)
            token_N = order_N // K
            y_ND = self.experts(x_TD[token_N], torch.bincount(expert_N, minlength=E))
            out_TD = torch.zeros_like(x_TD).index_add_(0, token_N, y_ND * top_scores_TK.flatten()[order_N, None])
        return (out_TD + self.shared(x_TD)).view_as(x_BSD)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.moe = MoE()

    def forward(self, h):
        return h + self.moe(self.norm(h))


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens_BS):
        h = self.embed(tokens_BS)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


EXPERT_PATHS = [f"layers.{i}.moe.experts" for i in range(LAYERS)]
ADAPTERS = {"StackedExperts": StackedExperts, "stacked [E, in, out]": GroupedSwiGLU}
RUNS = [*ADAPTERS, "StackedExperts + fully_shard"]  # the adapter named first


def _model(adapter=None):
    torch.manual_seed(0)
    model = TinyMoE()
    if adapter is not None:
        for path in EXPERT_PATHS:
            moe = model.get_submodule(path.rsplit(".", 1)[0])
            moe.experts = ADAPTERS[adapter](moe.experts)
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (STEPS, BATCH, S + 1), generator=g)
    return tokens[..., :-1], tokens[..., 1:]


def _train(model, rows, reduce_grads=None):
    """STEPS AdamW steps on the sequences `rows` of each batch; the loss is this part's share of
    the global mean (summed over the tokens here, divided by all tokens of the batch)."""
    inputs, labels = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, grads = [], []
    for step in range(STEPS):
        logits = model(inputs[step, rows])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[step, rows].flatten(), reduction="sum") / (BATCH * S)
        loss.backward()
        if reduce_grads is not None:
            loss = reduce_grads(model, loss.detach())
        losses.append(loss.item())
        grads.append({n: _whole(n, p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: _whole(n, p.detach()) for n, p in model.named_parameters()}


def _whole(name, t):
    # This rank's experts of an expert weight; an FSDP-sharded one gathered whole.
    if ".experts." in name or not isinstance(t, DTensor):
        return local(t).clone()
    return t.full_tensor()


def _sum_replicated_grads(model, loss):
    # Data parallel over the ep ranks for everything but the experts: each rank's gradient is its
    # part of the global mean's, so sum (FSDP's reduce-scatter did it for its own parameters).
    # Expert shards already hold every rank's contribution (the combine's all-to-all brings it
    # back in backward).
    for p in model.parameters():
        if not isinstance(p, DTensor):
            dist.all_reduce(p.grad)
    dist.all_reduce(loss)
    return loss


def _ep_rank(rank, world_size):
    meshes = build_meshes(ParallelDims(dp_shard=world_size, ep=world_size, world_size=world_size))
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    out = {}
    for run in RUNS:
        adapter = run.split(" + ")[0]
        model = _model(adapter)
        dispatchers = apply_expert_parallel(model, meshes.ep, EXPERT_PATHS)
        if run.endswith("fully_shard"):
            experts = {p for path in EXPERT_PATHS for p in model.get_submodule(path).parameters()}
            for unit in [*model.layers, model]:
                fully_shard(unit, mesh=meshes.dp_shard_cp, ignored_params=experts)
                # Each rank's loss is its part of the global mean: sum (SUM on the wire: gloo has
                # no PREMUL_SUM).
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        losses, grads, params = _train(model, rows, _sum_replicated_grads)
        experts = model.get_submodule(EXPERT_PATHS[0])
        out[run] = dict(
            losses=losses, grads=grads, params=params, syncs=[d.host_syncs for d in dispatchers.values()],
            local_experts=local(next(experts.parameters())).shape[0],
            dtensors=sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
            unstacked=experts.unstack().state_dict() if adapter == "StackedExperts" else None,
        )
        try:  # the call-site contract: counts as a keyword are refused with one line
            experts(torch.zeros(2, D), num_tokens_per_expert_E=torch.tensor([2, 0, 0, 0]))
        except TypeError as e:
            out[run]["keyword_error"] = str(e)
    return out


def _to_layout(named, adapter, rank, local_experts):
    """The reference's per-expert tensors (params or grads) in the adapter's stacked names,
    this rank's experts only: the checkpoint conversion, applied to the comparison."""
    converted = {n: t for n, t in named.items() if ".experts." not in n}
    shard = slice(rank * local_experts, (rank + 1) * local_experts)
    for path in EXPERT_PATHS:
        for name in ("w1", "w2", "w3"):
            per_expert = [named[f"{path}.{e}.{name}.weight"] for e in range(E)]
            if adapter == "StackedExperts":
                converted[f"{path}.{name}_weight"] = torch.stack(per_expert)[shard]
            else:
                converted[f"{path}.{name}"] = torch.stack([w.t() for w in per_expert])[shard]
    return converted


@pytest.fixture(scope="module")
def runs():
    torch.set_num_threads(1)
    reference = _train(_model(), slice(None))  # the model as written, whole batch, one process
    return reference, run_on_ranks(_ep_rank, 2, timeout=120)


@pytest.mark.parametrize("run", RUNS)
def test_user_moe_under_ep2_trains_like_one_process(runs, run):
    (ref_losses, ref_grads, ref_params), ranks = runs
    adapter = run.split(" + ")[0]
    for rank, result in enumerate(ranks):
        got = result[run]
        assert got["local_experts"] == E // 2
        expected_dtensors = sorted(n for n in got["params"] if ".experts." in n or run.endswith("fully_shard"))
        assert got["dtensors"] == expected_dtensors  # experts sharded by EP; the rest by FSDP, if asked
        assert got["syncs"] == [STEPS] * LAYERS  # the dispatch's one host sync per layer and step
        assert max(abs(a - b) for a, b in zip(got["losses"], ref_losses)) <= 1e-5, (got["losses"], ref_losses)
        for step in range(STEPS):
            expected = _to_layout(ref_grads[step], adapter, rank, E // 2)
            assert expected.keys() == got["grads"][step].keys()
            for name, ref in expected.items():
                diff = (got["grads"][step][name] - ref).abs().max() / ref.norm()
                assert diff <= 1e-4, (adapter, rank, step, name, diff.item())
        for name, ref in _to_layout(ref_params, adapter, rank, E // 2).items():
            assert (got["params"][name] - ref).abs().max() <= 1e-5, (adapter, rank, name)
        message = got["keyword_error"]
        assert "\n" not in message and "num_tokens_per_expert_E), both positional" in message


def test_stacked_experts_unstack_gives_back_the_trained_per_expert_modules(runs):
    (_, _, ref_params), ranks = runs
    for result in ranks:  # every rank gathers every expert
        unstacked = result["StackedExperts"]["unstacked"]
        for e in range(E):
            for name in ("w1", "w2", "w3"):
                ref = ref_params[f"{EXPERT_PATHS[0]}.{e}.{name}.weight"]
                assert (unstacked[f"{e}.{name}.weight"] - ref).abs().max() <= 1e-5


class _MeshNotToUse:
    """An ep mesh of 2 that fails if anything but its size is read: the checks come first."""

    def size(self, dim=None):
        return 2

    def __getattr__(self, name):
        raise AssertionError(f"ep_mesh.{name} used before the experts were validated")


class _NoReorder(nn.Module):
    def __init__(self, num_experts=E):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(num_experts, D, D))

    def forward(self, x_ND, num_tokens_per_expert_E):
        return x_ND


class _Contract(_NoReorder):
    permute_and_pad, unpermute = staticmethod(permute_and_pad), staticmethod(unpermute)


class _WithBias(_Contract):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(D))


class _WithChild(_Contract):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)


class _OneArgument(_Contract):
    def forward(self, x_ND):
        return x_ND


BAD = [
    (lambda: nn.ModuleList(MLP() for _ in range(E)), "holds no parameters of its own in sub-modules (0.w1.weight, 0.w2.weight, 0.w3.weight, ...): expert "
     "parallel shards only the weights a module holds itself, stacked [E, ...]; wrap per-expert modules in "
     "plait.expertparallel.StackedExperts(...)."),
    (_WithChild, "holds parameters in sub-modules (proj.weight, proj.bias): expert parallel shards only"),
    (_WithBias, "parameter 'b' has shape [16], not the experts on dim 0 (4 from 'w')"),
    (_NoReorder, "has no permute_and_pad: set permute_and_pad = staticmethod(plait.expertparallel.permute_and_pad)"),
    (_OneArgument, "forward(x_ND) does not take (routed_input_ND, num_tokens_per_expert_E) positionally"),
    (lambda: _Contract(num_experts=3), "parallelism.ep = 2 does not divide the 3 routed experts"),
]


@pytest.mark.parametrize("make, expected", BAD)
def test_experts_lacking_the_contract_are_refused_in_one_line_before_the_mesh_is_used(make, expected):
    holder = nn.Module()
    holder.good, holder.bad = _Contract(), make()
    # The good module first: nothing is sharded until every module has passed.
    with pytest.raises(ParallelConfigError) as error:
        apply_expert_parallel(holder, _MeshNotToUse(), ["good", "bad"])
    message = str(error.value)
    assert "\n" not in message and expected in message, message
    assert not isinstance(holder.good.w, DTensor)


def test_missing_path_and_unstackable_experts_are_one_line_errors():
    with pytest.raises(ParallelConfigError, match=r"^expert module 'moe.experts' is not a module path of the model"):
        apply_expert_parallel(nn.Module(), _MeshNotToUse(), ["moe.experts"])
    mixed = nn.ModuleList([MLP(), nn.Linear(D, D)])
    with pytest.raises(ValueError, match=r"^StackedExperts: expert 1 \(Linear\) has parameters") as error:
        StackedExperts(mixed)
    assert "\n" not in str(error.value)


def test_permute_and_pad_orders_expert_major_with_aligned_groups():
    # Rows arrive (source rank, local expert); expert-major with source order kept, groups padded.
    counts = torch.tensor([2, 0, 1, 3, 1, 2])  # ep 2 x 3 local experts
    x_ND = torch.arange(9.0)[:, None].expand(9, 2)
    x_padded_PD, permuted_P, m_sizes_E = permute_and_pad(x_ND, counts, 2, 3, 4)
    assert m_sizes_E.tolist() == [8, 4, 4]  # 2+3, 0+1, 1+2 tokens, each rounded up to 4
    # Static length: 9 rows + 3 groups x 3 padding at most, rounded up to 4 (the tail is padding).
    assert permuted_P.tolist() == [0, 1, 3, 4, 5, -1, -1, -1, 6, -1, -1, -1, 2, 7, 8, -1, -1, -1, -1, -1]
    assert torch.equal(unpermute(x_padded_PD, permuted_P, 9), x_ND)
    assert (x_padded_PD[permuted_P < 0] == 0).all()


def test_stacked_experts_run_any_expert_module_with_its_own_forward():
    # Experts with biases and another activation: every parameter stacked, each expert's forward.
    torch.manual_seed(0)
    experts = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(3))
    stacked = StackedExperts(experts)
    assert {n: tuple(p.shape) for n, p in stacked.named_parameters()} == {
        "0_weight": (3, H, D), "0_bias": (3, H), "2_weight": (3, D, H), "2_bias": (3, D)
    }
    counts = torch.tensor([2, 0, 3])
    x_ND = torch.randn(7, D)  # 5 rows in groups, 2 rows of padding past them
    y_ND = stacked(x_ND, counts)
    expected = torch.cat([experts[0](x_ND[:2]), experts[2](x_ND[2:5]), torch.zeros(2, D)])
    torch.testing.assert_close(y_ND, expected, rtol=0, atol=1e-6)
    back = stacked.unstack()
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), experts.state_dict().values()))

