import pytest

from plait.mesh import ParallelConfigError, ParallelDims


def test_dp_shard_is_inferred():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 2
    assert (dims.dp, dims.dp_shard_cp, dims.dp_cp) == (4, 2, 4)


def test_derived_degrees_for_moe():
    dims = ParallelDims(dp_shard=2, cp=2, tp=2, ep=4, etp=1, world_size=8)
    assert dims.efsdp == 2
    dims = ParallelDims(dp_shard=2, cp=2, tp=2, ep=4, etp=2, world_size=8)
    assert dims.efsdp == 1
    # ep 2 over dp_shard x cp = 4 with tensor-parallel experts is valid: a guard against over-strict checks.
    assert ParallelDims(dp_shard=2, cp=2, tp=2, ep=2, etp=2, world_size=8).efsdp == 2


def test_pp_is_outermost_and_leaves_the_stage_degrees_alone():
    dims = ParallelDims(pp=2, dp_shard=-1, tp=2, world_size=8)
    assert (dims.dp_shard, dims.stage_world_size, dims.dp, dims.dp_cp, dims.pp_enabled) == (2, 4, 2, 2, True)
    assert ParallelDims(world_size=4) == ParallelDims(world_size=4, pp=1)
    assert not ParallelDims(world_size=4).pp_enabled


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(dp_shard=3, world_size=8), ["world size is 8", "dp_shard = -1"]),
        (dict(dp_replicate=3, world_size=8), ["cannot infer parallelism.dp_shard", "dp_replicate"]),
        (dict(dp_shard=4, tp=0, world_size=4), ["parallelism.tp = 0", ">= 1"]),
        (dict(dp_shard=-2, world_size=4), ["parallelism.dp_shard = -2", "-1 to infer"]),
        (dict(dp_shard=4, tp=2, etp=4, world_size=8), ["parallelism.etp = 4", "1 or equal to tp"]),
        (dict(dp_shard=4, ep=3, world_size=4), ["parallelism.ep = 3", "must divide"]),
        (dict(dp_shard=2, cp=2, ep=2, tp=2, etp=1, world_size=8), ["must be a multiple of cp * tp = 4"]),
        (dict(dp_shard=2, tp=2.0, world_size=4), ["parallelism.tp must be an integer"]),
        (dict(pp=0, world_size=4), ["parallelism.pp = 0", ">= 1"]),
        (dict(pp=2, dp_shard=4, world_size=4), ["pp * dp_replicate * dp_shard * cp * tp = 2 * 1 * 4 * 1 * 1 = 8",
                                                 "world size is 4"]),
        (dict(pp=3, tp=2, world_size=8), ["cannot infer parallelism.dp_shard", "pp * dp_replicate * cp * tp"]),
    ],
)
def test_invalid_layouts_name_the_setting_and_the_fix(kwargs, words):
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(**kwargs)
    for word in words:
        assert word in str(err.value)
