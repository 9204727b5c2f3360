"""End-to-end runs of the CLI in subprocesses (1 rank, 2 ranks FSDP, gradient accumulation, SIGTERM).

All runs train the debug model on the shipped corpus with the same global batch (8 sequences of
64 tokens per step), in fp32 and deterministic mode, so their per-step losses must agree.
"""

import signal
import time
from pathlib import Path

import pytest

from plait.testing import trainer as testing
from plait.testing.trainer import losses, read_metrics, start_cli

KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_second", "mfu", "memory_gib"}
STEPS = 6
# fmt: off
COMMON = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.dtype", "float32",
    "--training.deterministic", "true",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "4",
    "--metrics.cpu_peak_tflops", "0.1",
]
# fmt: on


def run_cli(dump: Path, *args, timeout=180):
    return testing.run_cli(dump, *COMMON, *args, timeout=timeout)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The default run, shortened: 1 rank, batch 8."""
    dump = tmp_path_factory.mktemp("one_rank")
    result = run_cli(dump, "--training.local_batch_size", "8")
    return dump, result


def test_default_run_trains_and_writes_metrics(one_rank):
    dump, result = one_rank
    rows = read_metrics(dump)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step, log step or not
    for row in rows:
        assert KEYS <= row.keys()
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1
    assert list((dump / "tb").glob("events.out.tfevents.*"))
    assert "loss" in result.stdout and "Traceback" not in result.stderr
    assert (dump / "config.toml").is_file()


def test_two_rank_fsdp_matches_one_rank(one_rank, tmp_path):
    # comm.backend gloo: what ranks sharing a GPU run (on CPU gloo is auto's choice too)
    dump = tmp_path / "fsdp2"
    result = run_cli(dump, "--nproc-per-node", "2", "--training.local_batch_size", "4", "--comm.backend", "gloo")
    assert "dp mode fsdp" in result.stdout
    rows = read_metrics(dump)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(KEYS <= row.keys() for row in rows)
    assert list((dump / "tb").glob("events.out.tfevents.*"))
    assert losses(dump) == pytest.approx(losses(one_rank[0]), abs=1e-5, rel=0)


def test_gradient_accumulation_matches_the_big_batch(one_rank, tmp_path):
    dump = tmp_path / "accum"
    run_cli(dump, "--training.local_batch_size", "4", "--training.gradient_accumulation_steps", "2")
    assert losses(dump) == pytest.approx(losses(one_rank[0]), abs=1e-5, rel=0)


def test_bfloat16_and_moe_run(tmp_path):
    dump = tmp_path / "moe_bf16"
    run_cli(
        dump,
        "--model.name",
        "deepseek_v3",
        "--training.dtype",
        "bfloat16",
        "--training.local_batch_size",
        "2",
        "--training.activation_checkpoint",
        "selective",
    )
    values = losses(dump)
    assert len(values) == STEPS and values[-1] < values[0]


def test_sigterm_finishes_the_step_and_exits_cleanly(tmp_path):
    dump = tmp_path / "sigterm"
    proc = start_cli(dump, *COMMON, "--training.steps", "10000", "--metrics.log_freq", "1",
                     "--training.local_batch_size", "1", "--metrics.tensorboard", "false")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("step "):
                break
            assert line or proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err  # stopped before its steps: not 0, so schedulers requeue it
    assert "SIGTERM, stopped after step" in out
    rows = read_metrics(dump)
    assert 1 <= len(rows) < 10000
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
