"""Issue 27 faults that need a real `plait-train` process (the rest are tested in process where
their check lives): a resume from the "last good" checkpoint that diverges again at once, and
the run's description line. Tiny runs: the debug model, 2 sequences of 64 tokens."""

import subprocess
import sys
from pathlib import Path

from plait.testing.trainer import run_cli
from plait.trainer.cli import EXIT_DIVERGED

# fmt: off
COMMON = [
    "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.dtype", "float32",
    "--metrics.cpu_peak_tflops", "0.1", "--metrics.tensorboard", "false",
]
# fmt: on


def error_line(result) -> str:
    err = result.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0 and err.startswith("plait-train: error: "), err
    return err


def test_diverging_again_from_the_last_good_checkpoint_points_further_back(tmp_path: Path):
    # lr 1e6 without warmup: NaN from step 5, found at step 6's save; checkpoints 2 and 4 are finite.
    dump = tmp_path / "nan"
    diverging = [*COMMON, "--model.n_layers", "1", "--training.steps", "8", "--optimizer.lr", "1e6",
                 "--lr_scheduler.warmup_steps", "20000", "--metrics.log_freq", "20", "--checkpoint.enable", "true",
                 "--checkpoint.interval", "2", "--checkpoint.keep_last", "3"]
    result = run_cli(dump, *diverging, expect=EXIT_DIVERGED)
    first = error_line(result)
    # The description says what runs (it said "Llama 3 debug model, built-in corpus" whatever ran).
    assert "plait-train: llama3 debugmodel with n_layers=1 (" in result.stdout
    assert "tokens of builtin" in result.stdout and "built-in corpus" not in result.stdout
    assert "the last good checkpoint is" in first and "step-000004 (step 4), which the same command resumes" in first
    # The same command, as the message says: it resumes from step 4 and diverges again before a save.
    again = error_line(run_cli(dump, *diverging, expect=EXIT_DIVERGED))
    assert "this run resumed from" in again and "step-000004 (step 4) and diverged again" in again, again
    assert "resume from an earlier one with --checkpoint.load_step 2 (kept: 2)" in again, again
    assert "which the same command resumes from" not in again


def test_hf_export_module_runs_without_runpy_warning(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "plait.trainer.checkpoint.hf_export",
         "--checkpoint", str(tmp_path / "missing"), "--output", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )
    assert "RuntimeWarning" not in result.stderr and "found in sys.modules" not in result.stderr, result.stderr
    assert result.returncode == 2 and result.stderr.startswith("hf_export: error: checkpoint "), result.stderr
