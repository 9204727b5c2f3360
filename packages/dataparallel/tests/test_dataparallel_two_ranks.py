"""2 ranks: FSDP (each reshard policy, prefetch, CPU offload, bf16, meta-device init, gloo overlap),
replicate, DDP.

One spawn of 2 ranks runs every case; each test below checks one case's results against the
single-process reference (same seed, data and initial weights).
"""

import pytest
import torch
import torch.distributed as dist
from dataparallel_harness import (
    BLOCKS,
    EXPERTS,
    assert_parity,
    assert_sharded_bytes,
    build_model,
    full_params,
    global_batches,
    local_param_bytes,
    loss_fn,
    reference,
    reshard_after_forward_of,
    train,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.dataparallel.cpu_overlap import AllToAllReduceScatter, reduce_scatters_issued
from plait.mesh import ParallelConfigError, ParallelDims, build_meshes
from plait.testing import RankError, run_on_ranks

TIMEOUT = 240


def _run(meshes, config, model=None, edge_units=()):
    model = model if model is not None else build_model()
    model = apply_data_parallel(model, meshes, BLOCKS, config, edge_units=edge_units)
    grads = {}
    losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), first_grads=grads)
    model.first_grads = grads
    return model, losses


def _cases(rank, world_size):
    fsdp = build_meshes(ParallelDims(dp_shard=2, world_size=world_size))
    rep = build_meshes(ParallelDims(dp_replicate=2, dp_shard=1, world_size=world_size))
    out = {}

    model, losses = _run(fsdp, DataParallelConfig())
    out["fsdp"] = dict(
        losses=losses,
        params=full_params(model),
        grads=model.first_grads,
        bytes=local_param_bytes(model),
        reshard=reshard_after_forward_of(model),
        deferred=_deferred_reduce_scatters(model, fsdp.dp_rank),
    )
    for policy in ("always", "never"):
        model, losses = _run(fsdp, DataParallelConfig(reshard_after_forward=policy))
        out[f"fsdp_{policy}"] = dict(losses=losses, reshard=reshard_after_forward_of(model))
    # The prefetch chain runs embedding -> blocks -> head (and back in backward).
    edges = [["tok_embeddings"], ["norm", "output"]]
    out["fsdp_prefetch"] = dict(losses=_run(fsdp, DataParallelConfig(prefetch=True), edge_units=edges)[1])
    model, losses = _run(fsdp, DataParallelConfig(cpu_offload=True))
    out["fsdp_offload"] = dict(
        losses=losses,
        params=full_params(model),
        grads=model.first_grads,
        issued=reduce_scatters_issued(model.layers[0]),
    )

    # The trainer's flow: build on meta, shard, materialise, load the seed checkpoint.
    with torch.device("meta"):
        meta_model = build_model()
    meta_model = apply_data_parallel(meta_model, fsdp, BLOCKS, DataParallelConfig())
    meta_model.to_empty(device="cpu")
    set_model_state_dict(meta_model, build_model().state_dict(), options=StateDictOptions(full_state_dict=True))
    out["fsdp_meta"] = dict(losses=train(meta_model, fsdp.dp_rank, fsdp.dp_degree, fsdp.dp.get_group()))

    out["experts_ep_only"] = _experts_without_expert_fsdp(world_size)
    out["all_to_all_reduce_scatter"] = _all_to_all_vs_gloo_reduce_scatter()
    out["fsdp_bf16"] = _bf16_case(fsdp)
    out["replicate_bf16"] = _bf16_case(rep)

    model, losses = _run(rep, DataParallelConfig())
    out["replicate"] = dict(
        losses=losses,
        params=full_params(model),
        grads=model.first_grads,
        meshes={
            n: (p.device_mesh.ndim, p.device_mesh.size(), tuple(p.placements))
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        },
        plain=[n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
        state_dict={k: (type(v).__name__, tuple(v.shape)) for k, v in model.state_dict().items()},
        same_group=rep.dp_replicate.get_group() is next(model.parameters()).device_mesh.get_group(),
    )
    out["replicate_prefetch"] = dict(losses=_run(rep, DataParallelConfig(prefetch=True))[1])
    model, losses = _run(rep, DataParallelConfig(replicate_impl="ddp"))
    out["ddp"] = dict(losses=losses, params=full_params(model), grads=model.first_grads, wrapped=type(model).__name__)
    return out


def _deferred_reduce_scatters(model, dp_rank):
    """Gloo has no streams, so reduce-scatters whose output FSDP only views until backward ends are
    issued async (cpu_overlap). A second backward before zero_grad makes FSDP add into the gradients,
    which reads the output at once: those must be synchronous, and the sum exact."""
    tokens, labels = (t[dp_rank::2] for t in global_batches()[0])
    model.zero_grad()
    before = reduce_scatters_issued(model.layers[0])
    loss_fn(model(tokens), labels).backward()
    once = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    middle = reduce_scatters_issued(model.layers[0])
    loss_fn(model(tokens), labels).backward()
    after = reduce_scatters_issued(model.layers[0])
    doubled = all(torch.equal(p.grad.to_local(), 2 * once[n]) for n, p in model.named_parameters())
    model.zero_grad()
    return dict(
        first={k: middle[k] - before[k] for k in before},
        second={k: after[k] - middle[k] for k in before},
        doubled=doubled,
    )


def _all_to_all_vs_gloo_reduce_scatter():
    """FSDP's reduce-scatters on gloo run as an all-to-all of chunks summed in rank order: at 2
    ranks the same two-term sums as gloo's own reduce-scatter, bit for bit (odd and large sizes,
    both ops FSDP uses)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    same = {}
    for numel in (2, 6, 2 * 40_961):
        x = torch.randn(numel, generator=gen) * 1e3
        for op in AllToAllReduceScatter.OPS:
            want, got = torch.empty(numel // 2), torch.full((numel // 2,), float("nan"))
            dist.reduce_scatter_single(want, x, op=op)
            AllToAllReduceScatter(got, x, None, op).finish()
            same[f"{numel} {op}"] = torch.equal(got, want)
    return same


def _experts_without_expert_fsdp(world_size):
    """dp_shard 2, ep 2: ep takes every data rank, so experts are not FSDP-sharded (efsdp is 1) but
    their gradients are still divided by the data-parallel degree. Built on meta then materialised,
    as the trainer does: the gradient scaling must follow the new parameters. The test adds what EP's
    token exchange would: expert gradients summed over the ep axis."""
    meshes = build_meshes(ParallelDims(dp_shard=2, ep=2, world_size=world_size))
    with torch.device("meta"):
        model = build_model(n_experts=1)
    model = apply_data_parallel(model, meshes, BLOCKS, DataParallelConfig(), EXPERTS)
    model.to_empty(device="cpu")
    set_model_state_dict(model, build_model(n_experts=1).state_dict(), options=StateDictOptions(full_state_dict=True))

    def sum_over_ep(model):
        for p in model.get_submodule(EXPERTS[0]).parameters():
            dist.all_reduce(p.grad, group=meshes.ep.get_group())

    grads = {}
    losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), sum_over_ep, first_grads=grads)
    plain = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    return dict(losses=losses, grads=grads, params=full_params(model), plain=plain)


def _bf16_case(meshes):
    model = build_model()
    seen = []
    model.layers[0].w1.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, m.weight.dtype)))
    model, losses = _run(meshes, DataParallelConfig(param_dtype=torch.bfloat16), model)
    sharded = {p.dtype for p in model.parameters()}
    return dict(losses=losses, seen=sorted(set(seen), key=str), sharded=sharded)


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_cases, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("case", ["fsdp", "fsdp_offload", "replicate", "ddp"])
def test_parity_losses_and_params(results, ref, case):
    for rank_result in results:
        assert_parity(rank_result[case], ref)


@pytest.mark.parametrize("case", ["fsdp_always", "fsdp_never", "fsdp_prefetch", "fsdp_meta", "replicate_prefetch"])
def test_parity_losses(results, ref, case):
    for rank_result in results:
        assert_parity(rank_result[case], ref, params=False)


def test_fsdp_shards_parameters_in_half(results, ref):
    for rank_result in results:
        assert_sharded_bytes(rank_result["fsdp"]["bytes"], ref, 2)


def test_gloo_reduce_scatters_deferred_only_where_fsdp_just_views_the_output(results):
    units = len(BLOCKS) + 1  # the blocks and the root
    for rank_result in results:
        got = rank_result["fsdp"]["deferred"]
        assert got["first"] == {"deferred": units, "synchronous": 0}
        assert got["second"] == {"deferred": 0, "synchronous": units}  # accumulation reads it
        assert got["doubled"]
        # CPU offload copies the output off at once: never deferred
        assert rank_result["fsdp_offload"]["issued"]["deferred"] == 0


def test_all_to_all_reduce_scatter_is_gloos_bit_for_bit(results):
    for rank_result in results:
        cases = rank_result["all_to_all_reduce_scatter"]
        assert len(cases) == 6 and all(cases.values()), cases


def test_reshard_policies(results):
    last, root = BLOCKS[-1], ""
    expected_default = {b: True for b in BLOCKS[:-1]} | {last: False, root: False}
    assert results[0]["fsdp"]["reshard"] == expected_default
    assert results[0]["fsdp_always"]["reshard"] == {b: True for b in [*BLOCKS, root]}
    assert results[0]["fsdp_never"]["reshard"] == {b: False for b in [*BLOCKS, root]}


@pytest.mark.parametrize("case", ["fsdp_bf16", "replicate_bf16"])
def test_bf16_forward_by_policy(results, ref, case):
    for rank_result in results:
        got = rank_result[case]
        # inputs and the all-gathered weight are bf16 inside forward; the sharded copy stays fp32
        assert got["seen"] == [(torch.bfloat16, torch.bfloat16)]
        assert got["sharded"] == {torch.float32}
        assert got["losses"] == pytest.approx(ref["losses"], abs=5e-2, rel=1e-2)
        assert got["losses"] != pytest.approx(ref["losses"], abs=1e-6, rel=0)  # really ran in bf16


def test_replicate_is_on_the_1d_mesh_with_unwrapped_state_dict(results, ref):
    got = results[0]["replicate"]
    assert got["plain"] == []
    assert set(got["meshes"].values()) == {(1, 2, (Replicate(),))}
    assert got["same_group"]
    assert got["state_dict"] == {k: ("DTensor", tuple(v.shape)) for k, v in ref["params"].items()}


def test_experts_outside_fsdp_when_ep_takes_all_data_ranks(results):
    ref = reference(n_experts=1)
    for rank_result in results:
        got = rank_result["experts_ep_only"]
        assert got["plain"] == ["layers.1.experts.w1", "layers.1.experts.w2"]
        assert_parity(got, ref)


def test_ddp_wraps(results):
    assert results[0]["ddp"]["wrapped"] == "DistributedDataParallel"


def _bad_config(rank, world_size, config_kwargs, blocks):
    meshes = build_meshes(ParallelDims(dp_shard=world_size, world_size=world_size))
    apply_data_parallel(build_model(), meshes, blocks, DataParallelConfig(**config_kwargs))


@pytest.mark.parametrize(
    "config_kwargs, blocks, match",
    [
        (dict(reshard_after_forward=3), BLOCKS, r"reshard_after_forward = 3 must divide dp_shard \* cp = 2"),
        (dict(replicate_impl="ddp"), BLOCKS, r"replicate_impl = 'ddp'.*dp_shard \* cp = 2"),
        ({}, ["layers.0", "layer.1"], r"block 'layer.1' is not a submodule"),
    ],
)
def test_bad_config_fails_on_every_rank_without_hanging(config_kwargs, blocks, match):
    with pytest.raises(RankError, match=match) as info:
        run_on_ranks(_bad_config, 2, config_kwargs, blocks, timeout=60)
    assert ParallelConfigError.__name__ in str(info.value)
