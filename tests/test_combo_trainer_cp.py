"""The trainer with context parallel (a package plait-trainer does not declare): bad CP layouts
fail on every rank before any collective with one line, and the shipped 64K-token config
validates at its layout. (Parity of every CP method and combination with one rank:
test_combo_parity_matrix.py.)"""

import dataclasses

import pytest

from plait.testing.trainer import parity_args, run_cli
from plait.trainer.config import ConfigError, build_config, load_toml
from plait.trainer.validate import validate

COMMON = [*parity_args(steps=4), "--training.local_batch_size", "2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.seq_len", "66"], "training.seq_len = 66 is not divisible by 2 x parallelism.cp = 4"),
        (["--parallelism.cp_method", "zigzag"], "parallelism.cp_method"),
    ],
)
def test_bad_context_parallel_layouts_fail_on_every_rank(args, message, tmp_path):
    result = run_cli(tmp_path, "--nproc-per-node", "2", "--parallelism.cp", "2", *args, expect=None, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # The launcher reports the first failing rank's one line; no rank reached a collective.
    assert "Timed out" not in result.stderr


def test_ulysses_heads_not_divisible_by_tp_x_cp_is_refused():
    config = build_config({"parallelism": {"cp": 4, "tp": 8, "dp_shard": 1, "cp_method": "ulysses"},
                           "training": {"seq_len": 64}})
    with pytest.raises(ConfigError, match=r"splits the 16 attention heads over tp x cp = 32"):
        validate(config, world_size=32)


def test_shipped_64k_config_validates_at_its_layout():
    config = build_config(load_toml("llama3_8B_64k_cp.toml"))
    assert config.training.seq_len == 65536 and config.parallelism.cp == 8
    # Everything but the tokenizer file (downloaded with the release) is checked as shipped.
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer_path=""))
    plan = validate(config, world_size=64)
    assert plan.dims.cp == 8 and plan.dims.dp_shard == 8
    assert "contextparallel" in plan.parallel_modules["cp"].__name__
