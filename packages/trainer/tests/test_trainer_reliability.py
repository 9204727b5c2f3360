"""Faults against `plait-train` in real subprocesses with real signals (issue 13): a run never loses
its last good state, and every fault ends with a documented exit code and one line.

Every run trains the debug model on the shipped corpus, fp32 and deterministic, 2 sequences of
64 tokens per step, so runs that share a timeline have equal losses (`==`).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.checkpoint import store
from plait.testing.trainer import rank_pids, read_metrics, run_cli, start_cli
from plait.trainer.cli import EXIT_CONFIG, EXIT_DIVERGED, EXIT_STOPPED
from plait.trainer.config import LRSchedulerConfig
from plait.trainer.lr_scheduler import lr_factor

# fmt: off
COMMON = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--training.dtype", "float32",
    "--training.deterministic", "true",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.cpu_peak_tflops", "0.1",
    "--metrics.tensorboard", "false",
    "--checkpoint.enable", "true",
]
# fmt: on


def run(dump: Path, *args, env=None, expect=0, timeout=180) -> subprocess.CompletedProcess:
    return run_cli(dump, *COMMON, *args, env=env, expect=expect, timeout=timeout)


def complete_steps(dump: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (dump / "checkpoints").glob("step-*") if (p / ".complete").is_file())


def marker(dump: Path, step: int) -> dict:
    return json.loads((dump / "checkpoints" / store.step_name(step) / ".complete").read_text())


def losses(dump: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(dump)}


def one_error_line(result: subprocess.CompletedProcess) -> str:
    err = result.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0 and err.startswith("plait-train: error: "), err
    return err


def start(dump: Path, *args, nproc: int = 1) -> subprocess.Popen:
    """A long run in the background (log every step), for signals."""
    launcher = ["--nproc-per-node", str(nproc), "--training.local_batch_size", "1"] if nproc > 1 else []
    return start_cli(dump, *COMMON, *launcher, "--training.steps", "100000", "--metrics.log_freq", "1", *args)


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(f"step {step:>6}"):
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before step {step}: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"no step {step} within {timeout} s")


def test_a_diverged_run_publishes_no_nan_state_and_names_the_last_good_checkpoint(tmp_path):
    # The issue's command: NaN from step 5, found at step 6's save (log_freq 20 would find it at 20).
    dump = tmp_path / "nan"
    result = run(
        dump, "--training.steps", "20", "--optimizer.lr", "1e6", "--lr_scheduler.warmup_steps", "20000",
        "--metrics.log_freq", "20", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2",
        expect=EXIT_DIVERGED,
    )  # fmt: skip
    err = one_error_line(result)
    assert "is nan at step 5" in err and "last good checkpoint is" in err and "step-000004 (step 4)" in err
    assert complete_steps(dump) == [2, 4]  # keep_last pruned nothing for the NaN state
    assert (dump / "exit_status").read_text() == f"{EXIT_DIVERGED}\n"
    diverged = losses(dump)
    assert max(diverged) == 6 and all(diverged[s] == diverged[s] for s in (1, 2, 3, 4))  # finite up to the save
    assert not list((dump / "checkpoints").glob("*.tmp-*"))


def test_a_run_resumed_from_an_older_step_wins_over_the_abandoned_timeline(tmp_path):
    dump = tmp_path / "timeline"
    run(dump, "--training.steps", "12", "--checkpoint.interval", "4", "--checkpoint.keep_last", "2")
    assert complete_steps(dump) == [8, 12]
    # Roll back to step 8 with another lr (a new timeline); SIGKILL right after its step-10 save.
    branch = ["--training.steps", "12", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2",
              "--optimizer.lr", "1e-3"]  # fmt: skip
    result = run(dump, *branch, "--checkpoint.load_step", "8", env={"PLAIT_TEST_KILL_AFTER_SAVE": "10"}, expect=None)
    assert result.returncode == -signal.SIGKILL
    assert "optimizer.lr 0.003 -> 0.001" in result.stdout  # the new lr is applied, and said
    # Published by this run, step 10 is newer than the old timeline's step 12: 8 was pruned, not 10.
    assert complete_steps(dump) == [10, 12]
    assert marker(dump, 10)["published"] > marker(dump, 12)["published"]
    assert marker(dump, 10)["run_id"] != marker(dump, 12)["run_id"]
    result = run(dump, *branch)  # auto-resume
    assert "resuming from" in result.stdout and "step-000010 (step 10" in result.stdout, result.stdout
    assert complete_steps(dump) == [10, 12]  # step 12 of the new timeline replaced the old one
    assert marker(dump, 12)["published"] > marker(dump, 10)["published"]


def flip(file: Path) -> None:
    """Damage a file in place, keeping its size: only the checksum can tell."""
    data = bytearray(file.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def test_corrupt_checkpoint_bytes_are_detected_on_load(tmp_path):
    dump = tmp_path / "corrupt"
    run(dump, "--training.steps", "8", "--checkpoint.interval", "4")
    assert complete_steps(dump) == [4, 8] and marker(dump, 8)["checksums"].keys() == marker(dump, 8)["files"].keys()
    expected = losses(dump)
    flip(dump / "checkpoints" / "step-000008" / "__0_0.distcp")
    # Asked for by name: one line (DCP would load it silently, or fail with a BaseException).
    result = run(dump, "--training.steps", "8", "--checkpoint.interval", "4", "--checkpoint.load_step", "8",
                 expect=EXIT_CONFIG)  # fmt: skip
    err = one_error_line(result)
    assert "step-000008 is corrupt: __0_0.distcp does not match its checksum" in err and "checkpoint.load_step = 8" in err
    # Auto-resume: a warning, then the checkpoint before it; steps 5-8 again, bit for bit.
    result = run(dump, "--training.steps", "8", "--checkpoint.interval", "4")
    assert "warning: checkpoint: skipping checkpoint" in result.stdout and "does not match its checksum" in result.stdout
    assert "resuming from" in result.stdout and "step-000004 (step 4" in result.stdout
    assert losses(dump) == expected
    assert store.verify_checksums(dump / "checkpoints" / "step-000008", marker(dump, 8)) is None  # saved again


def test_one_run_per_dump_folder_and_sigterm_exits_75_with_a_checkpoint(tmp_path):
    dump = tmp_path / "locked"
    first = start(dump)
    try:
        wait_for_step(first, 2)
        lock = json.loads((dump / ".plait-run.lock").read_text())
        assert lock["pid"] == first.pid
        for layout in ([], ["--nproc-per-node", "2"]):  # one process, and the launcher before any rank
            t0 = time.monotonic()
            second = run(dump, "--training.steps", "4", *layout, expect=EXIT_CONFIG)
            assert "is in use by another run (pid" in one_error_line(second) and time.monotonic() - t0 < 60
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == EXIT_STOPPED, err
    assert (dump / "exit_status").read_text() == "75\n"
    steps = complete_steps(dump)
    assert len(steps) == 1 and steps[0] == max(losses(dump))
    assert f"the same command resumes from {dump / 'checkpoints' / store.step_name(steps[0])}" in err, err
    assert not (dump / ".plait-run.lock").exists()  # released at exit

    # A lock left by a SIGKILLed run (its pid is gone) is taken over with a warning.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (dump / ".plait-run.lock").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    result = run(dump, "--training.steps", str(steps[0] + 1))
    assert "took over the stale lock" in result.stdout


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_launcher_sigterm_stops_ranks_with_a_checkpoint_and_sigkill_takes_the_ranks_down(tmp_path):
    # SIGTERM to `plait-train --nproc-per-node 2`: the ranks finish the step and save, exit 75.
    dump = tmp_path / "term"
    proc = start(dump, "--job.stop_grace_s", "90", nproc=2)
    try:
        wait_for_step(proc, 2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
    assert (dump / "exit_status").read_text() == "75\n"  # written by the launcher, which held the lock
    steps = complete_steps(dump)
    assert len(steps) == 1 and steps[0] == max(losses(dump)) and marker(dump, steps[0])["world_size"] == 2

    # SIGKILL to the launcher: its ranks die with it (parent-death signal), no orphan keeps training.
    dump = tmp_path / "kill"
    proc = start(dump, nproc=2)
    try:
        wait_for_step(proc, 2)
        # The ranks, and every other process the launcher started (the ranks' clients and their
        # factory when forked: plait.trainer.rank_factory).
        ranks = [*rank_pids(proc.pid).values(), *_children(proc.pid)]
        assert len(rank_pids(proc.pid)) == 2, ranks
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(_gone(pid) for pid in ranks):
            time.sleep(0.2)
        assert all(_gone(pid) for pid in ranks), "ranks outlived their launcher"
    finally:
        for pid in _children(proc.pid) if proc.poll() is None else []:
            os.kill(pid, signal.SIGKILL)


def test_new_lr_and_more_steps_apply_on_resume(tmp_path):
    dump = tmp_path / "lr"
    run(dump, "--training.steps", "6", "--checkpoint.interval", "6", "--metrics.log_freq", "6")
    assert read_metrics(dump)[-1]["lr"] > 0
    result = run(dump, "--training.steps", "10", "--optimizer.lr", "1e-3", "--metrics.log_freq", "4")
    assert "optimizer.lr 0.003 -> 0.001, training.steps 6 -> 10" in result.stdout, result.stdout
    rows = {row["step"]: row["lr"] for row in read_metrics(dump)}
    schedule = LRSchedulerConfig(warmup_steps=2)
    for step in range(7, 11):  # the 10-step schedule from step 7 on, at the new peak (not lr 0)
        assert rows[step] == pytest.approx(1e-3 * lr_factor(step - 1, 10, schedule), rel=1e-12) and rows[step] > 0
