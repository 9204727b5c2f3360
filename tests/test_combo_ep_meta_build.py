"""Expert parallel at full size without the hardware: the shipped DeepSeek-V3 16B / 236B / 671B
configs validate, build their meshes and their sharded model on the meta device under a fake
process group of their world size, and routed experts get the placements FSDP x EP x TP needs
(the placement table of pytorch/pytorch PR #157216, "[DTensor][FSDP2] necessary changes to FSDP
and TP to unblock EP")."""

import json
import subprocess
import sys
import textwrap

import pytest

from plait.testing.trainer import cli_env

# One process builds every case (a fake process group per case): one torch import, not five.
BUILD = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from plait.mesh import build_meshes
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.parallelize import parallelize
    from plait.trainer.validate import validate

    def placements(p):
        return [repr(x) for x in p.placements] if isinstance(p, DTensor) else None

    for config_name, world, overrides in json.loads(sys.argv[1]):
        raw = load_toml(config_name)
        raw.setdefault("parallelism", {}).update({"async_tp": False, **overrides})  # async TP: CUDA only
        config = build_config(raw)
        config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, tokenizer_path="", init="sharded"),
            training=dataclasses.replace(config.training, compile=False),
        )
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        plan = validate(config, world_size=world)
        meshes = build_meshes(plan.dims, "cpu")
        model = parallelize(config, plan, meshes, torch.device("meta")).inner
        params = dict(model.named_parameters())
        # Under pipeline parallel rank 0 holds its stages' blocks only: their first experts.
        experts = next((e for e in plan.info.get("experts", ()) if e + ".w1" in params), None)
        w1, w2 = (params[experts + ".w1"], params[experts + ".w2"]) if experts else (None, None)
        print(json.dumps({
            "dims": {**dataclasses.asdict(plan.dims), "efsdp": plan.dims.efsdp},
            "w1": placements(w1) if experts else None,
            "w2": placements(w2) if experts else None,
            "w1_local": list(w1.to_local().shape) if experts else None,
            "w1_shape": list(w1.shape) if experts else None,
            "blocks": sorted({int(n.split(".")[1]) for n in params if n.startswith("layers.")}),
            "edges": sorted(n for n in params if not n.startswith("layers.")),
            "meta": all(p.is_meta or (isinstance(p, DTensor) and p.to_local().is_meta) for p in params.values()),
        }))
        dist.destroy_process_group()
    """
)

STRIDED = "_StridedShard(dim=0, sf=2)"
# name -> (config, world, parallelism overrides, expected w1 / w2 placements or None to skip)
CASES = {
    # the seed's table: FSDP 4, TP 2, EP 2 (experts' FSDP 2 since dp_shard mod ep == 2)
    "fsdp4_tp2_ep2_etp2": (
        "deepseek_v3_debugmodel.toml", 8, {"dp_shard": 4, "tp": 2, "ep": 2, "etp": 2},
        [STRIDED, "Shard(dim=0)", "Shard(dim=2)"], [STRIDED, "Shard(dim=0)", "Shard(dim=1)"],
    ),
    "hsdp2x4_tp2_ep2_etp2": (
        "deepseek_v3_debugmodel.toml", 16, {"dp_replicate": 2, "dp_shard": 4, "tp": 2, "ep": 2, "etp": 2},
        ["Replicate()", STRIDED, "Shard(dim=0)", "Shard(dim=2)"],
        ["Replicate()", STRIDED, "Shard(dim=0)", "Shard(dim=1)"],
    ),
    # etp 1: experts whole, sharded over ep (borrowed from dp_shard x tp) and FSDP over efsdp: on
    # the expert dim when efsdp divides the local experts, else on their input dim.
    "16B_64_ranks": ("deepseek_v3_16B.toml", 64, {}, ["_StridedShard(dim=0, sf=8)", "Shard(dim=0)"], None),
    "236B_128_ranks": ("deepseek_v3_236B.toml", 128, {}, ["_StridedShard(dim=0, sf=32)", "Shard(dim=0)"], None),
    # TP 8 (the shipped config before pipeline parallel): 4 local experts < efsdp 8, on the input dim.
    "671B_512_ranks_tp8": ("deepseek_v3_671B.toml", 512, {"pp": 1, "tp": 8, "layers_per_stage": []},
                           ["Shard(dim=1)", "Shard(dim=0)"], None),
    # As shipped: PP 8 x EP 64 x FSDP 64 (efsdp 1: experts sharded by ep alone).
    "671B_512_ranks": ("deepseek_v3_671B.toml", 512, {}, ["Shard(dim=0)"], ["Shard(dim=0)"]),
    "405B_512_ranks": ("llama3_405B.toml", 512, {}, None, None),
}
# Pipeline parallel as shipped: rank 0 holds stages 0 and pp (interleaved, 2 per rank), cut by the
# config's layers_per_stage; the embedding is on stage 0, the output head on the last stage.
PP_BLOCKS = {
    "671B_512_ranks": [0, 1, 2, *range(3 + 7 * 4, 3 + 8 * 4)],  # [3, 4 x 14, 2]: stage 8 starts at 31
    "405B_512_ranks": [*range(7), *range(7 + 7 * 8, 7 + 8 * 8)],  # [7, 8 x 14, 7]: stage 8 starts at 63
}


@pytest.fixture(scope="module")
def built():
    cases = [[config, world, overrides] for config, world, overrides, *_ in CASES.values()]
    result = subprocess.run(
        [sys.executable, "-c", BUILD, json.dumps(cases)], capture_output=True, text=True, env=cli_env(), timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(CASES), result.stdout
    return dict(zip(CASES, map(json.loads, lines)))


@pytest.mark.parametrize("case", CASES)
def test_expert_placements_and_meta_build(case, built):
    _, world, _, w1, w2 = CASES[case]
    got = built[case]
    assert got["meta"], "a parameter was materialised: the meta build must allocate nothing"
    dims = got["dims"]
    assert dims["world_size"] == world
    if case in PP_BLOCKS:
        assert dims["pp"] == 8 and got["blocks"] == PP_BLOCKS[case] and got["edges"] == ["tok_embeddings.weight"]
    if w1 is None:
        return  # a dense model
    assert got["w1"] == w1
    if w2 is not None:
        assert got["w2"] == w2
    # A rank holds about 1/(ep x efsdp x etp) of the experts' weights: E / ep experts split on E
    # (rank 0 holds the ceiling) or on the input dim over efsdp, and 1/etp of the hidden dim.
    E, dim, hidden = got["w1_shape"]
    on_experts = w1[-1 - (dims["etp"] > 1)] == "Shard(dim=0)" and "Shard(dim=1)" not in w1
    expected = [-(-(E // dims["ep"]) // dims["efsdp"]), dim, hidden // dims["etp"]] if on_experts else [
        E // dims["ep"], dim // dims["efsdp"], hidden // dims["etp"]]
    assert got["w1_local"] == expected
