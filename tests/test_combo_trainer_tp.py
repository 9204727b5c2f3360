"""The trainer with tensor parallel (a package plait-trainer does not declare): parity with 1 rank."""

import shutil

import pytest

from plait.trainer.testing import losses, read_metrics, run_cli

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


@pytest.mark.parametrize(
    "model, extra",
    [("llama3", []), ("deepseek_v3", []), ("deepseek_v3", ["--model.aux_loss_coeff", "0.01"])],
    ids=["llama3", "deepseek_v3", "deepseek_v3_aux_loss"],
)
def test_trainer_tensor_parallel_matches_one_rank(model, extra, tmp_path):
    # With the sequence-wise aux loss on, its gradient must arrive once, not once per TP rank.
    flavor = ["--model.name", model, "--model.flavor", "debugmodel", *extra]
    run_cli(tmp_path / "one", *COMMON, *flavor)
    # tp = 2 with sequence and loss parallel: both ranks see the same batch of 4.
    result = run_cli(tmp_path / "tp2", *COMMON, *flavor, "--nproc-per-node", "2", "--parallelism.tp", "2", timeout=300)
    assert "tp=2" in result.stdout
    assert losses(tmp_path / "tp2") == pytest.approx(losses(tmp_path / "one"), abs=1e-5, rel=0)


def test_fsdp_checkpoint_resumes_under_tensor_parallel(tmp_path):
    """4 ranks FSDP (local batch 1) saves at step 3; 2 ranks TP (local batch 4, the same global
    batch) resumes it through DCP resharding: steps 4-6 within 1e-5 of the 4-rank run."""
    # fmt: off
    common = [*COMMON, "--training.local_batch_size", "1", "--training.steps", "6",
              "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    # fmt: on
    four = tmp_path / "four"
    run_cli(four, *common, "--nproc-per-node", "4", timeout=300)
    tp = tmp_path / "tp2"
    shutil.copytree(four / "checkpoints" / "step-000003", tp / "checkpoints" / "step-000003")
    result = run_cli(tp, *common, "--nproc-per-node", "2", "--parallelism.tp", "2", "--training.local_batch_size", "4")
    assert "resharded from 4 ranks" in result.stdout
    expected = {row["step"]: row["loss"] for row in read_metrics(four)}
    resumed = {row["step"]: row["loss"] for row in read_metrics(tp)}
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([expected[s] for s in (4, 5, 6)], abs=1e-5, rel=0)
