"""The trainer with tensor parallel (a package plait-trainer does not declare): parity with 1 rank."""

import pytest

from plait.trainer.testing import losses, run_cli

# fmt: off
COMMON = [
    "--training.steps", "5",
    "--training.seq_len", "64",
    "--training.local_batch_size", "4",
    "--training.dtype", "float32",
    "--training.deterministic", "true",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "5",
    "--metrics.cpu_peak_tflops", "0.1",
]
# fmt: on


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_trainer_tensor_parallel_matches_one_rank(model, tmp_path):
    flavor = ["--model.name", model, "--model.flavor", "debugmodel"]
    run_cli(tmp_path / "one", *COMMON, *flavor)
    # tp = 2 with sequence and loss parallel: both ranks see the same batch of 4.
    result = run_cli(tmp_path / "tp2", *COMMON, *flavor, "--nproc-per-node", "2", "--parallelism.tp", "2", timeout=300)
    assert "tp=2" in result.stdout
    assert losses(tmp_path / "tp2") == pytest.approx(losses(tmp_path / "one"), abs=1e-5, rel=0)
