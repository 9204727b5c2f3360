"""The trainer with expert parallel (dp2ep, dropless all-to-all): DeepSeek-V3 debug (8 routed
experts, top-3) under EP 2 and 4, with expert FSDP (efsdp 2), with context parallel (ep borrowed
from the cp ranks), with HSDP, with tensor parallel (etp 1: each TP rank dispatches its share of
the rows; etp = tp: experts' hidden dim split too), with all of them at 8 ranks, and with
activation checkpointing + accumulation, each matches the one-rank run; bad EP layouts fail
before any collective with one line."""

import pytest

from plait.trainer.config import ConfigError, build_config
from plait.trainer.testing import losses, parity_args, run_cli
from plait.trainer.validate import validate

COMMON = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *parity_args(steps=4)]
# fmt: off
LAYOUTS = {  # name -> (ranks, local batch, extra args); the global batch is 4 everywhere
    "ep2": (2, 2, ["--parallelism.ep", "2"]),
    "fsdp4_ep2_efsdp2": (4, 1, ["--parallelism.ep", "2"]),
    "ep4": (4, 1, ["--parallelism.ep", "4"]),
    "cp2_ep2": (2, 4, ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--parallelism.ep", "2",
                       "--parallelism.cp_method", "ring"]),
    "hsdp2x2_ep2": (4, 1, ["--parallelism.dp_replicate", "2", "--parallelism.ep", "2"]),
    "ep2_full_ac_accum2": (2, 1, ["--parallelism.ep", "2", "--training.activation_checkpoint", "full",
                                  "--training.gradient_accumulation_steps", "2"]),
    # capacity mode with room for every token (factor = experts): the static all-to-all equals dropless
    "ep2_capacity_8": (2, 2, ["--parallelism.ep", "2", "--parallelism.expert_capacity_factor", "8"]),
    # etp 1: ep 2 is borrowed from the tp ranks; each dispatches half the rows (no token sent twice)
    "fsdp2_tp2_ep2": (4, 2, ["--parallelism.tp", "2", "--parallelism.ep", "2"]),
    "fsdp2_tp2_ep2_etp2": (4, 2, ["--parallelism.tp", "2", "--parallelism.ep", "2", "--parallelism.etp", "2"]),
    "tp2_ep2_capacity_8_no_sp": (2, 4, ["--parallelism.tp", "2", "--parallelism.ep", "2",
                                        "--parallelism.sequence_parallel", "false",
                                        "--parallelism.expert_capacity_factor", "8"]),
    "hsdp2x2_tp2_ep2": (8, 1, ["--parallelism.dp_replicate", "2", "--parallelism.tp", "2", "--parallelism.ep", "2"]),
    "fsdp2_cp2_tp2_ep4": (8, 2, ["--parallelism.cp", "2", "--parallelism.tp", "2", "--parallelism.ep", "4",
                                 "--parallelism.cp_method", "allgather"]),
}
# fmt: on


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    dump = tmp_path_factory.mktemp("one")
    run_cli(dump, *COMMON, "--training.local_batch_size", "4")
    return losses(dump)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_expert_parallel_matches_one_rank(layout, one_rank, tmp_path):
    ranks, batch, extra = LAYOUTS[layout]
    result = run_cli(
        tmp_path, *COMMON, "--training.local_batch_size", str(batch), "--nproc-per-node", str(ranks), *extra,
        timeout=300,
    )
    assert "ep=" in result.stdout
    assert losses(tmp_path) == pytest.approx(one_rank, abs=1e-5, rel=0)


def test_capacity_mode_drops_and_counts_tokens_over_capacity(tmp_path):
    result = run_cli(
        tmp_path, *COMMON, "--training.local_batch_size", "2", "--nproc-per-node", "2", "--parallelism.ep", "2",
        "--parallelism.expert_capacity_factor", "0.5", timeout=300,
    )
    dropped = int(result.stdout.split("expert capacity dropped ")[1].split()[0])
    assert dropped > 0
    assert all(loss == loss for loss in losses(tmp_path))  # trains (finite losses) with tokens dropped


@pytest.mark.parametrize(
    "parallelism, world, message",
    [
        ({"dp_shard": 16, "ep": 16}, 16, "parallelism.ep = 16 does not divide the 8 routed experts"),
        ({"dp_shard": 2, "tp": 4, "ep": 4, "etp": 2}, 8, "parallelism.etp = 2"),
        ({"dp_shard": 2, "tp": 4, "ep": 2}, 8, "parallelism.ep = 2 must be a multiple of cp \\* tp = 4"),
        ({"dp_shard": 2, "ep": 2, "expert_capacity_factor": -1.0}, 2, "expert_capacity_factor = -1.0"),
    ],
)
def test_bad_expert_parallel_layouts_fail_before_any_collective(parallelism, world, message):
    config = build_config({"model": {"name": "deepseek_v3"}, "parallelism": parallelism, "training": {"seq_len": 64}})
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=world)


def test_shipped_deepseek_v3_16b_config_validates_with_expert_parallel():
    import dataclasses

    from plait.trainer.config import load_toml

    config = build_config(load_toml("deepseek_v3_16B.toml"))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer_path=""))
    plan = validate(config, world_size=64)  # 8 nodes x 8 GPUs: ep 8 borrowed from dp_shard 64, efsdp 8
    assert plan.dims.ep == 8 and plan.dims.efsdp == 8
