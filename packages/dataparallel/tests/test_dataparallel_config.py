"""Mode choice, up-front validation and the autocast decision: no process group needed.

Validation reads only the degrees, the config and the module tree, so unbuilt `Meshes` (views all
None) stand in for a multi-rank layout here; every error is raised before any collective.
"""

import contextlib

import pytest
import torch
from dataparallel_harness import BLOCKS, EXPERTS, build_model

from plait.dataparallel import DataParallelConfig, apply_data_parallel, autocast_context, data_parallel_mode
from plait.mesh import Meshes, ParallelConfigError, ParallelDims, build_meshes


def unbuilt(**degrees) -> Meshes:
    return Meshes(dims=ParallelDims(**degrees), device_type="cpu")


@pytest.mark.parametrize(
    "degrees, impl, mode",
    [
        (dict(world_size=1), "fsdp", "none"),
        (dict(world_size=2, tp=2, dp_shard=1), "fsdp", "none"),
        (dict(world_size=4), "fsdp", "fsdp"),
        (dict(world_size=4, dp_shard=1, cp=4), "fsdp", "fsdp"),
        (dict(world_size=4, dp_replicate=2), "fsdp", "hsdp"),
        (dict(world_size=4, dp_replicate=2, dp_shard=1, cp=2), "fsdp", "hsdp"),
        (dict(world_size=4, dp_replicate=4, dp_shard=1), "fsdp", "replicate"),
        (dict(world_size=4, dp_replicate=4, dp_shard=1), "ddp", "ddp"),
    ],
)
def test_mode_follows_the_degrees(degrees, impl, mode):
    assert data_parallel_mode(ParallelDims(**degrees), DataParallelConfig(replicate_impl=impl)) == mode


def test_no_data_parallel_is_a_no_op():
    model = build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = apply_data_parallel(model, build_meshes(ParallelDims(world_size=1)), BLOCKS, DataParallelConfig())
    assert out is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


BAD = [
    (dict(world_size=2), dict(reshard_after_forward="sometimes"), BLOCKS, (), "reshard_after_forward = 'sometimes'"),
    (dict(world_size=2), dict(reshard_after_forward=True), BLOCKS, (), "reshard_after_forward = True"),
    (dict(world_size=2), dict(reshard_after_forward=0), BLOCKS, (), "reshard_after_forward = 0"),
    (dict(world_size=4), dict(reshard_after_forward=3), BLOCKS, (), r"must divide dp_shard \* cp = 4.*\[1, 2, 4\]"),
    (dict(world_size=8, ep=4), dict(reshard_after_forward=4), BLOCKS, EXPERTS, r"expert FSDP degree \(efsdp\) = 2"),
    (dict(world_size=2), dict(replicate_impl="torch"), BLOCKS, (), "replicate_impl = 'torch'"),
    (dict(world_size=4, dp_replicate=2), dict(replicate_impl="ddp"), BLOCKS, (), r"'ddp' with dp_shard \* cp = 2"),
    (dict(world_size=4, dp_replicate=2, dp_shard=1, tp=2), dict(replicate_impl="ddp"), BLOCKS, (), "'tp': 2"),
    (
        dict(world_size=2, dp_replicate=2, dp_shard=1),
        dict(replicate_impl="ddp", param_dtype=torch.bfloat16),
        BLOCKS,
        (),
        "DDP has no mixed precision policy",
    ),
    (
        dict(world_size=2, dp_replicate=2, dp_shard=1),
        dict(replicate_impl="ddp", cpu_offload=True),
        BLOCKS,
        (),
        "DDP cannot offload",
    ),
    (dict(world_size=2), dict(param_dtype=torch.int8), BLOCKS, (), "param_dtype = torch.int8"),
    (dict(world_size=2), dict(reduce_dtype="fp32"), BLOCKS, (), "reduce_dtype = 'fp32'"),
    (dict(world_size=2), {}, ["layers.0", "blocks.1"], (), r"block 'blocks.1' is not a submodule"),
    (dict(world_size=2), {}, ["layers.0", "layers.0"], (), "listed twice"),
    (dict(world_size=2), {}, ["layers", "layers.0"], (), "nested in block 'layers'"),
    (dict(world_size=2), {}, "layers.0", (), "lists of module paths"),
    (dict(world_size=2), {}, BLOCKS, ["layers.1.expert"], "expert module 'layers.1.expert' is not a submodule"),
    (dict(world_size=2), {}, BLOCKS, ["layers.1"], "both as blocks and as expert modules"),
    # views never built (no build_meshes): caught before fully_shard would fail or hang
    (dict(world_size=2), {}, BLOCKS, (), "meshes.fsdp is None"),
]


@pytest.mark.parametrize("degrees, config, blocks, experts, match", BAD)
def test_bad_settings_raise_before_any_collective(degrees, config, blocks, experts, match):
    with pytest.raises(ParallelConfigError, match=match):
        apply_data_parallel(build_model(n_experts=2), unbuilt(**degrees), blocks, DataParallelConfig(**config), experts)


def test_ddp_needs_materialised_parameters():
    with torch.device("meta"):
        model = build_model()
    config = DataParallelConfig(replicate_impl="ddp")
    with pytest.raises(ParallelConfigError, match="meta device"):
        apply_data_parallel(model, unbuilt(world_size=2, dp_replicate=2, dp_shard=1), BLOCKS, config)


def test_autocast_only_on_a_single_process():
    bf16 = DataParallelConfig(param_dtype=torch.bfloat16)
    single = build_meshes(ParallelDims(world_size=1))
    ctx = autocast_context(single, bf16, "cpu")
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16
    with autocast_context(None, bf16, "cpu"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    for meshes, config in [
        (single, DataParallelConfig()),
        (single, DataParallelConfig(param_dtype=torch.float32)),
        (unbuilt(world_size=2), bf16),  # FSDP: the policy casts
        (unbuilt(world_size=2, dp_shard=1, tp=2), bf16),  # TP only: never autocast on DTensors
    ]:
        assert isinstance(autocast_context(meshes, config, "cpu"), contextlib.nullcontext)
