"""`--model.name qwen3`: the dense and MoE debug flavors train in one process, and qwen3's own model
arguments (head_dim, n_routed_experts = 0 for dense) are checked in one line before anything is built."""

import pytest

from plait.testing.trainer import parity_args, train_in_process
from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate

QWEN3 = ["--config", "qwen3_debugmodel.toml", "--metrics.tensorboard", "false", "--training.local_batch_size", "4",
         "--model.n_layers", "2"]  # fmt: skip


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_debug_flavors_train(tmp_path, flavor):
    rows = train_in_process(tmp_path, *QWEN3, *parity_args(steps=6, lr=3e-3), "--model.flavor", flavor,
                            "--metrics.log_freq", "1")  # fmt: skip
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"]
    # The MoE flavor's routers report their load, one entry per MoE block; the dense one has none.
    assert ("moe_imbalance" in rows[-1]) == (flavor == "debugmodel_moe")
    if flavor == "debugmodel_moe":
        assert len(rows[-1]["moe_imbalance"]) == 2


def check(*overrides):
    return validate(build_config(None, [("model.name", "qwen3"), ("training.seq_len", "64"), *overrides]), 1)


@pytest.mark.parametrize("overrides, message", [
    ([("model.head_dim", "31")], "model.head_dim = 31 (qwen3 debugmodel): must be even for RoPE."),
    ([("model.head_dim", "0")], "model.head_dim = 0 (qwen3 debugmodel): must be >= 2."),
    ([("model.n_routed_experts", "-1")], "model.n_routed_experts = -1 (qwen3 debugmodel): must be >= 0."),
    ([("model.flavor", "debugmodel_moe"), ("model.n_activated_experts", "9")],
     "model.n_activated_experts = 9 (qwen3 debugmodel_moe): must be in [1, n_routed_experts = 8]."),
    ([("model.n_kv_heads", "3")], "model.n_heads = 8 (qwen3 debugmodel) is not divisible by model.n_kv_heads = 3"),
])  # fmt: skip
def test_qwen3_ranges(overrides, message):
    with pytest.raises(ConfigError) as info:
        check(*overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_head_dim_is_its_own_setting_and_zero_experts_is_dense():
    # dim 200 is not a multiple of 8 heads: fine, Qwen3's head size is head_dim, not dim / n_heads.
    assert check(("model.dim", "200"), ("model.head_dim", "48"))
    # The MoE flavor with no routed experts is the dense model (its top-k is then unused).
    assert check(("model.flavor", "debugmodel_moe"), ("model.n_routed_experts", "0"))
    export = [("model.flavor", "debugmodel_moe"), ("checkpoint.enable", "true"), ("checkpoint.last_save_in_hf", "true")]
    assert check(*export)
    # Auxiliary-loss-free balancing has no Hugging Face form: refused before step 1, in one line.
    with pytest.raises(ConfigError) as info:
        check(*export, ("model.load_balance_coeff", "0.001"))
    assert str(info.value).startswith("checkpoint.last_save_in_hf = true but qwen3 debugmodel_moe cannot be exported: "
                                      "Hugging Face's Qwen3-MoE routes without a selection bias") and "\n" not in str(info.value)
