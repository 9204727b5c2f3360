"""Model arguments out of range, and an HF export the model cannot be written as, are one line
each before anything is built (issue 27, defects 5 and 6). In process: `validate` is where the
checks live; the CLI prints its ConfigError as is and exits 2."""

import pytest

from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate

DEEPSEEK = [("model.name", "deepseek_v3"), ("model.flavor", "debugmodel"), ("training.seq_len", "64")]


def check(*overrides):
    return validate(build_config(None, list(overrides)), 1)


@pytest.mark.parametrize("field, value, message", [
    ("dim", "0", "model.dim = 0 (llama3 debugmodel): must be >= 1."),
    ("n_heads", "0", "model.n_heads = 0 (llama3 debugmodel): must be >= 1."),
    ("n_kv_heads", "0", "model.n_kv_heads = 0 (llama3 debugmodel): must be >= 1."),
    ("n_kv_heads", "3", "model.n_heads = 16 (llama3 debugmodel) is not divisible by model.n_kv_heads = 3"),
    ("dim", "250", "model.dim = 250 (llama3 debugmodel) is not divisible by model.n_heads = 16"),
    ("multiple_of", "0", "model.multiple_of = 0 (llama3 debugmodel): must be >= 1."),
    ("n_layers", "0", "model.n_layers = 0 (llama3 debugmodel): must be >= 1."),
    ("n_layers", "-1", "model.n_layers = -1 (llama3 debugmodel): must be >= 1."),
    ("rope_theta", "0", "model.rope_theta = 0.0 (llama3 debugmodel): must be > 0."),
    ("rope_theta", "-5", "model.rope_theta = -5.0 (llama3 debugmodel): must be > 0."),
    ("norm_eps", "-1e-5", "model.norm_eps = -1e-05 (llama3 debugmodel): must be > 0."),
])
def test_llama_ranges(field, value, message):
    with pytest.raises(ConfigError) as info:
        check((f"model.{field}", value))
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("field, value, message", [
    ("moe_inter_dim", "0", "model.moe_inter_dim = 0 (deepseek_v3 debugmodel): must be >= 1."),
    ("q_lora_rank", "-4", "model.q_lora_rank = -4 (deepseek_v3 debugmodel): must be >= 0."),
    ("kv_lora_rank", "0", "model.kv_lora_rank = 0 (deepseek_v3 debugmodel): must be >= 1."),
    ("v_head_dim", "0", "model.v_head_dim = 0 (deepseek_v3 debugmodel): must be >= 1."),
    ("n_activated_experts", "0", "model.n_activated_experts = 0 (deepseek_v3 debugmodel): must be in [1, "
                                 "n_routed_experts = 8]."),
    ("n_activated_experts", "9", "model.n_activated_experts = 9 (deepseek_v3 debugmodel): must be in [1, "
                                 "n_routed_experts = 8]."),
    ("n_shared_experts", "-1", "model.n_shared_experts = -1 (deepseek_v3 debugmodel): must be >= 0."),
    ("route_scale", "-1", "model.route_scale = -1.0 (deepseek_v3 debugmodel): must be > 0."),
    ("aux_loss_coeff", "-1", "model.aux_loss_coeff = -1.0 (deepseek_v3 debugmodel): must be >= 0."),
    ("n_limited_groups", "2", "model.n_limited_groups = 2 (deepseek_v3 debugmodel): must be in [1, "
                              "n_expert_groups = 1]."),
])
def test_deepseek_ranges(field, value, message):
    with pytest.raises(ConfigError) as info:
        check(*DEEPSEEK, (f"model.{field}", value))
    assert str(info.value).startswith(message), str(info.value)


def test_valid_overrides_still_pass_and_trainer_settings():
    assert check(("model.n_layers", "1"), ("model.dim", "64"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"))
    assert check(*DEEPSEEK, ("model.n_activated_experts", "8"), ("model.q_lora_rank", "0"))
    with pytest.raises(ConfigError, match=r"parallelism.expert_capacity_factor = -1.0: use 0 \(dropless\)"):
        check(("parallelism.expert_capacity_factor", "-1"))  # ep 1, where it is not used
    with pytest.raises(ConfigError, match=r"data.prefetch = 100000: must be in \[0, 16\]"):
        check(("data.prefetch", "100000"))
    assert check(("data.prefetch", "16"))


def test_last_save_in_hf_checked_before_step_1():
    """Softmax-routed DeepSeek flavors have no HF DeepseekV3 form: refused now, not after the run."""
    export = [("checkpoint.enable", "true"), ("checkpoint.last_save_in_hf", "true")]
    with pytest.raises(ConfigError) as info:
        check(*DEEPSEEK, *export)
    message = str(info.value)
    assert message.startswith("checkpoint.last_save_in_hf = true but deepseek_v3 debugmodel cannot be exported: "
                              "Hugging Face's DeepseekV3 scores experts with a sigmoid and this model routes with "
                              "softmax") and "train with --model.score_func sigmoid" in message
    assert "\n" not in message
    assert check(*DEEPSEEK, *export, ("model.score_func", "sigmoid"))
    assert check(*export)  # llama3 exports


@pytest.mark.parametrize("overrides, message", [
    ([("model.n_layers", "2000000")], "model.n_layers = 2000000 make llama3 "),
    ([*DEEPSEEK, ("model.n_layers", "100000"), ("model.mtp_layers", "40"), ("training.seq_len", "64")],
     "model.n_layers = 100000 and model.mtp_layers = 40 make deepseek_v3 "),
])
def test_a_model_too_deep_for_memory_is_refused_before_it_is_built(overrides, message, monkeypatch):
    """Issue 53, item 6: at these depths the meta build alone takes minutes; the refusal comes from
    the parameter count of one- and two-block builds (each count exact, as shown for the shipped
    flavors), so no model deeper than two blocks is built."""
    import dataclasses

    from plait.trainer import size_bound

    built = []
    real_count = size_bound.parameter_count

    def counting(spec, args):
        cls = spec.model_cls
        spy = dataclasses.replace(spec, model_cls=lambda a: built.append(a.n_layers) or cls(a))
        return real_count(spy, args)

    monkeypatch.setattr(size_bound, "parameter_count", counting)
    with pytest.raises(ConfigError) as info:
        validate(build_config(None, list(overrides)), 1, check_memory=True)
    assert str(info.value).startswith(message) and "lower model.n_layers" in str(info.value), str(info.value)
    assert built and max(built) <= 2, built


@pytest.mark.parametrize("name, flavor, mtp", [("llama3", "8B", 0), ("deepseek_v3", "16B", 0), ("deepseek_v3", "debugmodel", 3)])
def test_the_bounds_parameter_count_is_the_built_models(name, flavor, mtp):
    import dataclasses

    import torch

    from plait.models import get_model_spec
    from plait.trainer.size_bound import parameter_count

    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], **({"mtp_layers": mtp} if mtp else {}))
    with torch.device("meta"):
        built = sum(p.numel() for p in spec.model_cls(args).parameters())
    assert parameter_count(spec, args) == built
