"""FSDP x TP through plait-train prints no "FSDP2-wrapped module (FSDPEmbedding) returned a view
tensor ... wrong gradients" warning (issue 27, noise): FSDP's post-forward hook runs before tensor
parallel's `to_local` on the embedding (trainer/fsdp_tp.py), and the losses are still those of
one process, so the embedding's gradients still reach FSDP."""

import pytest

from plait.testing.trainer import read_metrics, run_cli

# fmt: off
COMMON = [
    "--model.n_layers", "1", "--training.steps", "3", "--training.seq_len", "64", "--training.dtype", "float32",
    "--training.deterministic", "true", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3",
    "--metrics.cpu_peak_tflops", "0.1", "--metrics.tensorboard", "false", "--metrics.log_freq", "1",
]
# fmt: on


def test_fsdp_tp_run_has_no_view_warning_and_matches_one_process(tmp_path):
    one = run_cli(tmp_path / "one", *COMMON, "--training.local_batch_size", "4")
    fsdp_tp = run_cli(tmp_path / "fsdp_tp", *COMMON, "--nproc-per-node", "4", "--parallelism.tp", "2",
                      "--training.local_batch_size", "2", timeout=300)
    assert "dp mode fsdp" in fsdp_tp.stdout and "tp=2" in fsdp_tp.stdout
    output = fsdp_tp.stdout + fsdp_tp.stderr
    assert "returned a view tensor" not in output and "wrong gradients" not in output, output
    expected = [row["loss"] for row in read_metrics(tmp_path / "one")]
    got = [row["loss"] for row in read_metrics(tmp_path / "fsdp_tp")]
    assert len(got) == 3 and got == pytest.approx(expected, abs=1e-5, rel=0)
    assert "returned a view tensor" not in one.stdout + one.stderr
