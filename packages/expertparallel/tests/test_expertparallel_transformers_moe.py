"""transformers 5's own MoE models under expert parallel (issue 44): `Qwen3MoeForCausalLM` and
`MixtralForCausalLM`, built here from tiny configs (fp32, no hub download), adapted by
`adapt_transformers_experts` (the experts keep transformers' stacked `gate_up_proj [E, 2F, D]` /
`down_proj [E, D, F]` and their names) and never otherwise edited:

- ep2: EP 2 on 2 ranks, each rank half the batch; everything but the experts replicated, its
  gradients averaged by hand;
- fsdp4_ep2: dp_shard 4 with EP 2 on 4 ranks: the experts EP 2 x FSDP 2 (`meshes.expert_fsdp`),
  everything else FSDP 4;
- fsdp8_ep2: dp_shard 8 with EP 2 on 8 ranks: the experts EP 2 x FSDP 4, FSDP-sharded on dim 1
  (2 local experts < 4 ranks), everything else FSDP 8.
FSDP is plait-dataparallel's `apply_data_parallel` (experts first over `expert_fsdp` with their
gradients divided by every rank, then each decoder layer and the root over `fsdp`). Each run trains 3 AdamW steps against the unmodified model (transformers' eager
experts loop) on the whole batch in this process: losses, every gradient at every step (AdamW
would hide a wrong gradient scale) and every parameter after the last step within 1e-5. The
router aux loss (`output_router_logits`) stays off: transformers computes it from each rank's own
tokens, which no data-parallel run reproduces.

One spawn per world size serves every case and model of that size. The README's transformers
example runs as printed in tests/test_combo_readme_blocks.py.
"""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.tensor import DTensor

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.expertparallel import TransformersExperts, adapt_transformers_experts, apply_expert_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

HIDDEN, FFN, LAYERS, E, K, VOCAB = 64, 32, 2, 4, 2, 256
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-3  # batch 8: one sequence per rank on 8 ranks
TOL, TIMEOUT = 1e-5, 240
MODELS = ("qwen3_moe", "mixtral")
EXPERT_PATHS = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
CASES = {"ep2": 2, "fsdp4_ep2": 4, "fsdp8_ep2": 8}  # name -> world size (dp_shard; ep 2 borrowed from it)
# A layer's gate_up_proj [E, 2F, D] on rank 0: 2 experts per ep rank, FSDP-split again on dim 0, or on
# dim 1 when the expert-FSDP ranks outnumber them (plait-dataparallel's rule); its placements.
LOCAL_GATE_UP = {
    "ep2": ((2, 2 * FFN, HIDDEN), ["Shard(dim=0)"]),
    "fsdp4_ep2": ((1, 2 * FFN, HIDDEN), ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]),
    "fsdp8_ep2": ((2, 2 * FFN // 4, HIDDEN), ["Shard(dim=1)", "Shard(dim=0)"]),
}


def make_model(name: str) -> nn.Module:
    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_experts_per_tok=K,
        output_router_logits=False,
    )
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=FFN, num_experts=E, **common)
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(intermediate_size=FFN, num_local_experts=E, **common)
        model_class = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return model_class(config).float()


def batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def whole(named) -> dict[str, torch.Tensor]:
    """Every tensor whole (a collective for DTensors: every rank calls it in the same order)."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in named}


def train(model, rows: slice, reduce=None):
    """STEPS AdamW steps on the sequences `rows` of each batch (this rank's mean loss); returns
    the global mean losses, each step's whole gradients and the whole parameters at the end."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, grads = [], []
    for batch in batches():
        tokens, labels = batch[rows, :-1], batch[rows, 1:]
        loss = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        loss = loss.detach()
        if reduce is not None:
            loss = reduce(model, loss)
        losses.append(loss.item())
        grads.append(whole((n, p.grad) for n, p in model.named_parameters()))
        opt.step()
        opt.zero_grad()
    return losses, grads, whole(model.named_parameters())


def average_by_hand(model, loss):
    """EP without FSDP: the replicated parameters' gradients averaged over the ranks; the expert
    shards already hold every rank's tokens (the combine's backward) and are only divided."""
    world = dist.get_world_size()
    for p in model.parameters():
        if not isinstance(p, DTensor):
            dist.all_reduce(p.grad)
        p.grad.div_(world)
    return average_loss(model, loss)


def average_loss(model, loss):
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def run_case(case: str, name: str, rank: int, world_size: int) -> dict:
    meshes = build_meshes(ParallelDims(dp_shard=world_size, ep=2, world_size=world_size))
    model = make_model(name)
    paths = adapt_transformers_experts(model)
    dispatchers = apply_expert_parallel(model, meshes.ep, paths)
    if case != "ep2":
        blocks = [f"model.layers.{i}" for i in range(len(model.model.layers))]
        apply_data_parallel(model, meshes, blocks, DataParallelConfig(), expert_modules=paths)
    per = BATCH // world_size
    reduce = average_by_hand if case == "ep2" else average_loss
    losses, grads, params = train(model, slice(rank * per, (rank + 1) * per), reduce)
    gate_up = model.get_submodule(paths[0]).gate_up_proj
    return dict(
        losses=losses,
        grads=grads,
        params=params,
        paths=paths,
        placements=[repr(p) for p in gate_up.placements],
        local_shape=tuple(gate_up.to_local().shape),
        syncs=[d.host_syncs for d in dispatchers.values()],
    )


def _rank_cases(rank: int, world_size: int, cases: list[str]) -> dict:
    torch.set_num_threads(1)
    out = {(case, name): run_case(case, name, rank, world_size) for case in cases for name in MODELS}
    # Only rank 0's whole tensors come back (every rank gathered the same); the others' losses.
    return out if rank == 0 else {key: run["losses"] for key, run in out.items()}


@pytest.fixture(scope="module")
def reference():
    """Each model unmodified (transformers' eager experts loop), whole batch, one process."""
    torch.set_num_threads(1)
    out = {}
    for name in MODELS:
        model = make_model(name)
        model.set_experts_implementation("eager")
        out[name] = train(model, slice(None))
    return out


@pytest.fixture(scope="module")
def spawns():
    results = {}

    def of(world_size: int) -> list:
        if world_size not in results:
            cases = [case for case, size in CASES.items() if size == world_size]
            results[world_size] = run_on_ranks(_rank_cases, world_size, cases, timeout=TIMEOUT)
        return results[world_size]

    return of


def _max_diff(got: dict, ref: dict) -> tuple[float, str]:
    assert got.keys() == ref.keys()  # transformers' own parameter names, adapted or not
    return max(((got[n] - ref[n]).abs().max().item(), n) for n in ref)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("case", CASES)
def test_transformers_moe_under_expert_parallel_trains_like_one_process(reference, spawns, case, name):
    ref_losses, ref_grads, ref_params = reference[name]
    world_size = CASES[case]
    ranks = spawns(world_size)
    got = ranks[0][(case, name)]
    for rank in ranks:
        losses = rank[(case, name)] if rank is not ranks[0] else got["losses"]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    for step in range(STEPS):
        diff, where = _max_diff(got["grads"][step], ref_grads[step])
        assert diff <= TOL, (case, name, step, where, diff)
    diff, where = _max_diff(got["params"], ref_params)
    assert diff <= TOL, (case, name, where, diff)
    assert got["paths"] == EXPERT_PATHS
    assert got["syncs"] == [STEPS] * LAYERS  # the dispatch's one host sync per layer and step, no more
    assert (got["local_shape"], got["placements"]) == LOCAL_GATE_UP[case]


def test_adaptation_keeps_parameters_names_and_outputs():
    model = make_model("mixtral")
    state = {n: t.clone() for n, t in model.state_dict().items()}
    experts = model.model.layers[0].mlp.experts
    params = dict(experts.named_parameters())
    tokens = batches()[0, :2, :-1]
    expected = model(input_ids=tokens).logits
    assert adapt_transformers_experts(model) == EXPERT_PATHS
    assert adapt_transformers_experts(model) == EXPERT_PATHS  # idempotent
    assert isinstance(experts, TransformersExperts) and isinstance(
        experts, transformers.models.mixtral.modeling_mixtral.MixtralExperts
    )
    assert dict(experts.named_parameters()) == params  # the same Parameter objects
    assert list(model.state_dict()) == list(state)  # transformers' keys: an HF checkpoint loads as is
    with torch.no_grad():
        experts.gate_up_proj.zero_()
    model.load_state_dict(state)  # the checkpoint taken before adaptation, loaded after it
    offsets = []  # issue 53: on one rank the groups went to grouped_mm unpadded
    grouped_mm = torch._grouped_mm

    def spy(*args, offs, **kwargs):
        offsets.append(offs.clone())
        return grouped_mm(*args, offs=offs, **kwargs)

    with mock.patch.object(torch, "_grouped_mm", spy):
        torch.testing.assert_close(model(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)
    assert offsets and all((o % TransformersExperts.group_alignment == 0).all() for o in offsets), offsets


def test_unsupported_experts_are_refused_in_one_line():
    model = make_model("qwen3_moe")
    model.model.layers[1].mlp.experts.has_bias = True  # e.g. GPT-OSS's experts
    with pytest.raises(
        ValueError,
        match=r"^adapt_transformers_experts: 'model.layers.1.mlp.experts' \(Qwen3MoeExperts\) "
        r"has has_bias = True: only experts with has_bias = False",
    ) as error:
        adapt_transformers_experts(model)
    assert "\n" not in str(error.value)
    assert not isinstance(model.model.layers[0].mlp.experts, TransformersExperts)  # checked before any change
    with pytest.raises(ValueError, match=r"^adapt_transformers_experts: Linear has no module holding gate_up_proj"):
        adapt_transformers_experts(nn.Linear(2, 2))
