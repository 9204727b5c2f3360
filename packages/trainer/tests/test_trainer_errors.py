"""Configuration errors: one clear line, a non-zero exit, no traceback, before any rank starts."""

import os
import subprocess
import sys

import pytest

from plait.trainer.cli import main
from plait.trainer.config import ConfigError, build_config
from plait.trainer.failures import TrainingDiverged, check_finite
from plait.trainer.validate import validate


def run_cli(*args, timeout=120):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "plait.trainer", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.seq_lne", "64"], "unknown config key 'training.seq_lne'. Did you mean training.seq_len?"),
        (["--model.tokenizer_path", "/nonexistent/tok.model"], "tokenizer file not found: /nonexistent/tok.model"),
    ],
)
def test_cli_errors_in_a_subprocess(args, message):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0  # one line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parallelism.dp_shard", "2"], "but the world size is 1"),
        (["--nproc-per-node", "2", "--parallelism.tp", "3"], "world size 2 is not divisible"),
        (["--training.seq_len", "4096"], "seq_len not matching the model"),
        (
            ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--nproc-per-node", "2"],
            "install plait-contextparallel",
        ),
        (["--parallelism.ep", "2", "--nproc-per-node", "2"], "install plait-expertparallel"),
        (["--model.flavor", "debugmode"], "Did you mean debugmodel?"),
        # ranks that share a GPU need gloo; nccl needs CUDA (these tests run without a GPU)
        (["--nproc-per-node", "2", "--comm.backend", "nccl"], "comm.backend = nccl needs CUDA GPUs and this machine"),
        (["--comm.backend", "nccl"], "use --comm.backend gloo (or auto)"),
        (["--comm.backend", "mpi"], "comm.backend"),
        (["--training.steps", "0"], "training.steps = 0: must be >= 1"),
        (["--data.val_dataset", "", "--data.val_interval", "5"], "data.val_dataset is empty"),
        (["--optimizer.lr", "nan"], "optimizer.lr = 'nan': must be a finite number"),
        (["--optimizer.lr", "inf"], "optimizer.lr = 'inf': must be a finite number"),
        (["--training.max_norm", "nan"], "training.max_norm = 'nan': must be a finite number"),
        (["--optimizer.betas", "0.9,-inf"], "optimizer.betas = '-inf': must be a finite number"),
        (["--job.dump_folder", ""], "job.dump_folder = '' is empty"),
        (["--checkpoint.enable", "true", "--checkpoint.folder", ""], 'checkpoint.folder = "": name a folder'),
        (["--training.compile_mode", "reduce-overhead"], "applies to compiled blocks: set training.compile = true"),
        # issue 40 fault probes 10 and 19: pipeline settings at pp 1, the seed's range.
        (["--parallelism.pipeline_schedule", "Bogus"], "'Bogus' is not a pipeline schedule: use one of"),
        (["--parallelism.pipeline_microbatch_size", "0"], "pipeline_microbatch_size = 0: must be >= 1"),
        # issue 53: a stage split at pp 1 was accepted and ignored
        (["--parallelism.layers_per_stage", "1,1"], "layers_per_stage = [1, 1] applies to pipeline stages"),
        (["--model.name", "deepseek_v3", "--model.mtp_layers", "8", "--training.seq_len", "8"],
         "model.mtp_layers = 8 needs training.seq_len > 8"),
        (["--job.seed", "-1"], "job.seed = -1: must be in [0, 2^63)"),
        (["--job.seed", str(2**63)], "must be in [0, 2^63)"),
        (
            ["--nproc-per-node", "2", "--training.compile", "true", "--training.compile_mode", "reduce-overhead"],
            "FSDP / HSDP free and re-allocate the unsharded parameters",
        ),
    ],
)
def test_config_errors(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("plait-train: error: ") and err.count("\n") == 1


def test_tensor_parallel_divisibility_is_checked_before_any_collective():
    # 16 heads cannot be split over 32 ranks; this is a local check (no process group exists).
    config = build_config(None, [("parallelism.tp", "32"), ("parallelism.dp_shard", "1")])
    with pytest.raises(ConfigError, match="parallelism.tp = 32"):
        validate(config, world_size=32)


def test_tokenizer_larger_than_the_model_vocab(tmp_path):
    # A BPE file with more ranks than the debug model's 2048 ids.
    import base64

    ranks = [bytes([b]) for b in range(256)] + [f"tok{i}".encode() for i in range(2000)]
    path = tmp_path / "big.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    config = build_config(None, [("model.tokenizer_path", str(path))])
    with pytest.raises(ConfigError, match="the tokenizer has 2512 tokens but llama3 debugmodel has vocab_size = 2048"):
        validate(config, world_size=1)


def test_non_finite_loss_names_the_step():
    rows = [{"step": 3, "loss": 5.0, "grad_norm": 1.0}, {"step": 4, "loss": float("nan"), "grad_norm": 1.0}]
    with pytest.raises(TrainingDiverged, match="loss is nan at step 4: .*optimizer.lr"):
        check_finite(rows)


def test_unwritable_folders_are_found_before_training(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["--job.dump_folder", str(a_file / "run")]) == 2
    err = capsys.readouterr().err
    assert f"job.dump_folder = '{a_file / 'run'}' is not a folder ({a_file} is a file)" in err and err.count("\n") == 1
    args = ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "true", "--checkpoint.folder", str(a_file)]
    assert main(args) == 2
    assert f"checkpoint.folder = '{a_file}' is not a folder" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes into read-only folders anyway
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
        assert main(["--job.dump_folder", str(read_only / "run")]) == 2
        assert "is not writable" in capsys.readouterr().err
