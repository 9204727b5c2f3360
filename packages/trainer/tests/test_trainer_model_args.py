"""Model arguments as config keys (`[model]` / `--model.<field>`), and checks that moved before the
model is built: DDP with bf16, missing datasets — each a one-line error naming the real fix."""

import pytest

from plait.trainer.cli import main
from plait.trainer.config import ConfigError, build_config, load_toml
from plait.trainer.validate import validate


def _config(*overrides, toml=None):
    return build_config(toml, [(k, v) for k, v in zip(overrides[::2], overrides[1::2])])


def test_model_arguments_override_the_flavor():
    config = _config("model.n_layers", "2", "model.max_seq_len", "4096", "training.seq_len", "4096")
    plan = validate(config)
    assert plan.model_args.n_layers == 2 and plan.model_args.max_seq_len == 4096
    assert len(plan.info["blocks"]) == 2
    toml = {"model": {"name": "deepseek_v3", "aux_loss_coeff": 0.01, "n_dense_layers": 1, "n_layers": 2}}
    plan = validate(build_config(toml))
    assert plan.model_args.aux_loss_coeff == 0.01 and plan.model_args.n_layers == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.n_layrs", "2"), "unknown config key 'model.n_layrs': not a [model] key nor an argument of llama3 "
                                 "debugmodel. Did you mean model.n_layers?"),
        (("model.n_layers", "two"), "model.n_layers = 'two': expected an integer."),
        (("model.n_heads", "7"), "model.dim = 256 (llama3 debugmodel) is not divisible by model.n_heads = 7"),
        (("model.rope_scaling", "8"), "model.rope_scaling = '8': set it as a table in the TOML file"),
        (("training.seq_len", "4096"), "lower training.seq_len, or raise model.max_seq_len (--model.max_seq_len 4096"),
        (("parallelism.dp_replicate", "2", "parallelism.replicate_impl", "ddp", "training.dtype", "bfloat16"),
         "parallelism.replicate_impl = 'ddp' with training.dtype = 'bfloat16': DDP has no mixed-precision policy. "
         "Use parallelism.replicate_impl = 'fsdp'"),
        (("parallelism.dp_replicate", "2", "parallelism.dp_shard", "2", "parallelism.replicate_impl", "ddp"),
         "does not compose with {'dp_shard': 2}"),
        (("data.dataset", "json"), "data.dataset = 'json': dataset 'json' reads local files: set dataset_path"),
        (("data.dataset", "/no/such/corpus.jsonl"), "dataset not found: '/no/such/corpus.jsonl'"),
        (("data.dataset", "text", "data.dataset_path", "/no/such/dir/train.txt"), "dataset_path not found"),
        (("data.val_dataset", "./missing.parquet", "data.val_interval", "5"), "data.val_dataset = './missing.parquet'"),
    ],
)
def test_errors_name_the_fix_before_the_model_is_built(overrides, message, monkeypatch):
    import plait.trainer.validate as v

    # Fail the test if validation got as far as building the model before raising.
    monkeypatch.setattr(v, "_has_compiler", lambda: pytest.fail("validation went past the model"))
    world = (4 if "parallelism.dp_shard" in overrides else 2) if "parallelism.dp_replicate" in overrides else 1
    with pytest.raises(ConfigError) as err:
        validate(_config(*overrides), world_size=world)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert "data_parallel.param_dtype" not in str(err.value)


def test_print_config_lists_model_arguments_and_round_trips(capsys, tmp_path):
    assert main(["--print-config", "--model.n_layers", "3"]) == 0
    text = capsys.readouterr().out
    assert "n_layers = 3" in text and "dim = 256" in text and "max_seq_len = 2048" in text
    path = tmp_path / "printed.toml"
    path.write_text(text)
    plan = validate(build_config(load_toml(str(path))))
    assert plan.model_args.n_layers == 3 and plan.model_args.dim == 256
