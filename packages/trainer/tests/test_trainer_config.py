"""Config parsing, TOML round trip, CLI argument parsing, shipped configs (no training, fast)."""

from dataclasses import fields

import pytest
import tomllib

from plait.trainer.cli import main, parse_args
from plait.trainer.config import (
    SECTIONS,
    Config,
    ConfigError,
    all_keys,
    build_config,
    field_docs,
    help_text,
    load_toml,
    shipped_configs,
    to_toml,
)

STABLE_KEYS = """
job.dump_folder job.seed model.name model.flavor model.tokenizer_path data.dataset data.dataset_path
data.text_field data.streaming data.val_dataset data.val_interval data.val_steps training.steps
training.local_batch_size training.seq_len training.gradient_accumulation_steps training.dtype
training.deterministic training.compile training.activation_checkpoint
training.activation_checkpoint_every training.max_norm parallelism.dp_replicate parallelism.dp_shard
parallelism.cp parallelism.cp_method parallelism.tp parallelism.sequence_parallel
parallelism.loss_parallel parallelism.async_tp parallelism.ep parallelism.etp
parallelism.replicate_impl parallelism.reshard_after_forward parallelism.fsdp_prefetch optimizer.name optimizer.lr
optimizer.weight_decay optimizer.betas optimizer.eps optimizer.implementation
lr_scheduler.warmup_steps lr_scheduler.decay lr_scheduler.decay_ratio lr_scheduler.min_lr_ratio
checkpoint.folder checkpoint.interval checkpoint.keep_last metrics.log_freq metrics.tensorboard
metrics.profile_interval
""".split()


def test_stable_names_exist_and_every_field_is_documented():
    keys = set(all_keys())
    assert set(STABLE_KEYS) <= keys
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"


def test_help_lists_every_key():
    text = help_text()
    for key in all_keys():
        assert f"--{key} " in text


def test_overrides_are_typed():
    config = build_config(
        None,
        [
            ("training.steps", "7"),
            ("optimizer.lr", "1e-3"),
            ("training.deterministic", "true"),
            ("optimizer.betas", "0.8,0.99"),
            ("training.dtype", "bfloat16"),
            ("job.dump_folder", "/tmp/x"),
        ],
    )
    assert config.training.steps == 7
    assert config.optimizer.lr == 1e-3
    assert config.training.deterministic is True
    assert config.optimizer.betas == (0.8, 0.99)
    assert config.training.dtype == "bfloat16"
    assert config.job.dump_folder == "/tmp/x"


def test_toml_then_overrides_in_order():
    toml = {"training": {"steps": 3, "seq_len": 128}, "optimizer": {"betas": [0.9, 0.9]}}
    config = build_config(toml, [("training.steps", "5")])
    assert config.training.steps == 5 and config.training.seq_len == 128
    assert config.optimizer.betas == (0.9, 0.9)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("training.setps", "3", "Did you mean training.steps?"),
        ("optimiser.lr", "3", "Did you mean optimizer.lr?"),
        ("training.steps", "three", "expected an integer"),
        ("training.dtype", "fp8", "choose one of float32, bfloat16"),
        ("training.compile", "maybe", "expected true or false"),
        ("optimizer.betas", "0.9", "expected 2 values"),
    ],
)
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        build_config(None, [(key, value)])


def test_unknown_section_in_toml():
    with pytest.raises(ConfigError, match=r"Did you mean training\?"):
        build_config({"trainig": {"steps": 1}})


def test_print_config_round_trips():
    config = build_config(None, [("training.steps", "9"), ("optimizer.betas", "0.5,0.6")])
    again = build_config(tomllib.loads(to_toml(config, with_docs=True)))
    assert again == config


def test_every_shipped_config_parses():
    names = shipped_configs()
    for model, flavors in {
        "llama3": ["debugmodel", "1B", "3B", "8B", "70B", "405B"],
        "deepseek_v3": ["debugmodel", "16B", "236B", "671B"],
        "qwen3": ["debugmodel", "8B", "30B_A3B", "235B_A22B"],
    }.items():
        for flavor in flavors:
            assert f"{model}_{flavor}.toml" in names
    assert "kimi_k2.toml" in names
    for name in names:
        config = build_config(load_toml(name))
        assert isinstance(config, Config)
        # Named model_flavor ("-" written "_"), or by the flavor alone where it is a family of its
        # own (kimi_k2.toml: deepseek_v3's kimi_k2).
        flavor = config.model.flavor.replace("-", "_")
        assert name.startswith((f"{config.model.name}_{flavor}", flavor)), name


def test_parse_args_forms():
    args = parse_args(
        ["--nproc-per-node", "2", "--training.steps=4", "--training.compile", "--optimizer.lr", "-1", "--print-config"]
    )
    assert args.nproc_per_node == 2
    assert args.overrides == [("training.steps", "4"), ("training.compile", "true"), ("optimizer.lr", "-1")]
    assert args.print_config
    # what the ranks get: everything but the launcher's own option
    assert args.forward == ["--training.steps=4", "--training.compile", "--optimizer.lr", "-1", "--print-config"]


def test_unknown_option_suggests(capsys):
    assert main(["--print-confg"]) == 2
    assert "Did you mean --print-config?" in capsys.readouterr().err


def test_print_config_with_no_arguments_is_the_debug_model(capsys):
    assert main(["--print-config"]) == 0
    config = build_config(tomllib.loads(capsys.readouterr().out))
    assert (config.model.name, config.model.flavor) == ("llama3", "debugmodel")
    assert config.data.dataset == "builtin"


def test_missing_config_file(capsys):
    assert main(["--config", "/nonexistent/x.toml"]) == 2
    assert "config file not found: /nonexistent/x.toml" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, device_type, explicit",
    [
        ((), "cuda", False),
        ((), "cpu", True),  # no streams: only an explicit prefetch overlaps gloo's all-gathers
        ((("parallelism.ep", "2"),), "cuda", True),
        ((("parallelism.ep", "2"), ("parallelism.fsdp_prefetch", "implicit")), "cpu", False),
        ((("parallelism.fsdp_prefetch", "explicit"),), "cuda", True),
    ],
)
def test_fsdp_prefetch_reaches_the_data_parallel_config(overrides, device_type, explicit):
    from plait.trainer.parallelize import data_parallel_config

    assert data_parallel_config(build_config(None, list(overrides)), device_type).prefetch is explicit
