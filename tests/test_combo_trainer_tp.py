"""The trainer with tensor parallel (a package plait-trainer does not declare): a checkpoint saved
under FSDP resumes under TP. (Parity of every TP layout with one rank: test_combo_parity_matrix.py.)"""

import shutil

import pytest

from plait.testing.trainer import read_metrics, run_cli

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
