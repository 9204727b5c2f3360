"""Exit codes a scheduler can trust (issue 40): requeue (74, 75) only what a restart can cure.

Real `plait-train` processes; faults injected at a step with PLAIT_TEST_FAULT (train.py), which
raises there what the fault raises."""

import signal
import time

import torch

from plait.testing.trainer import rank_pids, run_cli, start_two_ranks
from plait.trainer import exit_codes
from plait.trainer.failures import exit_code_of, infrastructure_fault

# fmt: off
TINY = [
    "--model.n_layers", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.dtype", "float32", "--training.steps", "3", "--metrics.tensorboard", "false",
    "--metrics.progress_bar", "false", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
    "--data.val_interval", "0",
]
# fmt: on


def _status(dump) -> str:
    return (dump / exit_codes.STATUS_FILE).read_text().strip()


def test_classification():
    assert exit_code_of(torch.OutOfMemoryError("CUDA out of memory")) == exit_codes.OUT_OF_MEMORY
    assert exit_code_of(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried")) == exit_codes.OUT_OF_MEMORY
    assert exit_code_of(RuntimeError("Connection closed by peer")) == exit_codes.INFRA
    mismatch = RuntimeError("Detected mismatch between collectives on ranks. Rank 0 is running collective: ...")
    assert not infrastructure_fault(mismatch) and exit_code_of(mismatch) == exit_codes.ERROR
    assert set(exit_codes.REQUEUE).isdisjoint(exit_codes.NOT_REQUEUED)


def test_out_of_memory_is_not_requeued(tmp_path):
    dump = tmp_path / "oom"
    result = run_cli(dump, *TINY, env={"PLAIT_TEST_FAULT": "2:oom"}, expect=exit_codes.OUT_OF_MEMORY)
    last = result.stderr.strip().splitlines()[-1]
    assert "out of memory" in last and "not requeued" in last and "Traceback" not in result.stderr, result.stderr
    assert _status(dump) == str(exit_codes.OUT_OF_MEMORY)


def test_a_fault_that_repeats_at_the_same_step_stops_asking_for_a_requeue(tmp_path):
    dump = tmp_path / "repeat"
    fault = {"PLAIT_TEST_FAULT": "2:lost_peer"}
    first = run_cli(dump, *TINY, env=fault, expect=exit_codes.INFRA)
    assert "requeue" in first.stderr.strip().splitlines()[-1] and _status(dump) == str(exit_codes.INFRA)
    second = run_cli(dump, *TINY, env=fault, expect=exit_codes.REPEATED)
    last = second.stderr.strip().splitlines()[-1]
    assert "failed at step 2 as well" in last and "not requeued" in last, last
    assert _status(dump) == str(exit_codes.REPEATED)
    # A transient fault at another step is requeued again; a finished run clears the history.
    run_cli(dump, *TINY, env={"PLAIT_TEST_FAULT": "3:lost_peer"}, expect=exit_codes.INFRA)
    run_cli(dump, *TINY)
    assert _status(dump) == "0" and not (dump / exit_codes.HISTORY_FILE).exists()


def test_a_configuration_error_replaces_a_stale_status(tmp_path):
    """A requeued job (status 75 from its preemption) that fails its configuration on the new node
    must not leave 75 behind: the SLURM recipe would requeue it forever."""
    dump = tmp_path / "stale"
    dump.mkdir()
    (dump / exit_codes.STATUS_FILE).write_text("75\n")
    run_cli(dump, *TINY, "--model.tokenizer_path", str(tmp_path / "missing.model"), expect=exit_codes.CONFIG)
    assert _status(dump) == str(exit_codes.CONFIG)


def test_ctrl_c_under_the_launcher_exits_130(tmp_path):
    dump = tmp_path / "ctrl-c"
    proc = start_two_ranks(dump, *TINY, until="metrics.jsonl")
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == exit_codes.INTERRUPTED, err[-3000:]
    assert _status(dump) == str(exit_codes.INTERRUPTED)


def test_a_stall_blames_the_stalled_rank():
    from plait.trainer.launch import failure_summary
    from plait.trainer.rank_notes import TIMEOUT

    notes = {0: {"step": 12, "cause": TIMEOUT, "time": 1.0}}
    text, code = failure_summary({0: 74, 1: -9}, {0: 100, 1: 130}, 2, notes, 15.0)
    assert text.startswith("rank 1 of 2 stalled: rank 0 timed out at step 12 after 15 s") and code == 74, text
    # Without notes: a rank killed after the first failure is the launcher's doing, not the OOM killer.
    text, _ = failure_summary({0: 74, 1: -9}, {0: 100, 1: 130}, 2)
    assert "rank 1 was killed by SIGKILL" in text and "OOM" not in text.split("then", 1)[1], text


def test_a_stopped_rank_costs_the_timeout_not_ten_minutes_and_is_named(tmp_path):
    """Fault probe 4: with one rank SIGSTOPped the others waited out a fixed 600 s, then the launcher
    blamed the healthy rank 0 and called the stopped one "killed by SIGKILL: the OOM killer"."""
    import os

    dump = tmp_path / "stall"
    proc = start_two_ranks(dump, *TINY, "--job.collective_timeout_s", "15", "--job.stop_grace_s", "5",
                           until="metrics.jsonl")
    try:
        ranks = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = rank_pids(proc.pid)
            time.sleep(0.2)
        began = time.monotonic()
        os.kill(ranks[1], signal.SIGSTOP)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert time.monotonic() - began < 120, "waited far past job.collective_timeout_s"
    last = err.strip().splitlines()[-1]
    assert proc.returncode == exit_codes.INFRA, err[-3000:]
    assert last.startswith("plait-train: rank 1 of 2 stalled: rank 0 timed out"), last


def test_forked_ranks_are_the_spawned_ranks_twin(tmp_path):
    """plait-train --nproc-per-node forks its ranks from a factory that imported the trainer once
    (plait.trainer.rank_factory; job.rank_start = auto on a CPU build of torch): the same losses,
    the same failure line and exit code through torch's agent as spawned ranks, and both ranks'
    own exit codes reach the launcher's summary."""
    from plait.testing.trainer import losses

    env = {"PLAIT_TEST_FAULT": "2:lost_peer"}
    runs = {start: run_cli(tmp_path / start, *TINY, "--nproc-per-node", "2", "--job.rank_start", start, env=env,
                           expect=exit_codes.INFRA) for start in ("fork", "spawn")}  # fmt: skip
    last = {start: r.stderr.strip().splitlines()[-1].replace(str(tmp_path / start), "DUMP") for start, r in runs.items()}
    assert last["fork"] == last["spawn"] and last["fork"].startswith("plait-train: rank 0 of 2 failed first"), last
    # (A launcher that cannot fork says so, and spawns.)
    assert "then rank 1" in last["fork"] and "spawning the ranks instead" not in runs["fork"].stderr, last
    assert losses(tmp_path / "fork") == losses(tmp_path / "spawn") and len(losses(tmp_path / "fork")) == 1
    assert _status(tmp_path / "fork") == _status(tmp_path / "spawn") == str(exit_codes.INFRA)


def test_a_warm_forked_run_is_the_fresh_runs_twin(tmp_path, monkeypatch):
    """run_cli forks plait-train from a process that imported it once (plait.testing.warm_cli):
    the exit code, the output and what the run reads from its environment are a fresh
    interpreter's. A fault at step 2 is exit 74 with the same last line and the same step-1 loss
    either way; a variable torch reads at import (not PLAIT_*) gets a server started with it."""
    from plait.testing import warm_cli
    from plait.testing.trainer import cli_env, losses

    env = {"PLAIT_TEST_FAULT": "2:lost_peer"}
    warm = run_cli(tmp_path / "warm", *TINY, env=env, expect=exit_codes.INFRA)
    monkeypatch.setenv("PLAIT_TEST_FRESH_CLI", "1")
    fresh = run_cli(tmp_path / "fresh", *TINY, env=env, expect=exit_codes.INFRA)
    last = [r.stderr.strip().splitlines()[-1].replace(str(tmp_path / name), "DUMP")
            for r, name in ((warm, "warm"), (fresh, "fresh"))]
    assert last[0] == last[1] and "infrastructure fault" in last[0], last
    assert losses(tmp_path / "warm") == losses(tmp_path / "fresh") and len(losses(tmp_path / "warm")) == 1
    assert _status(tmp_path / "warm") == _status(tmp_path / "fresh") == str(exit_codes.INFRA)
    monkeypatch.delenv("PLAIT_TEST_FRESH_CLI")
    # A variable torch reads at import: a server started with it; one read while running: the same server.
    assert "TORCH_LOGS" in warm_cli.import_environment({**cli_env(), "TORCH_LOGS": "dynamo"})
    assert warm_cli.import_environment({**cli_env(), "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PLAIT_X": "1"}) == \
        warm_cli.import_environment(cli_env())
    for env in ({**cli_env(), "TORCH_LOGS": "dynamo"}, cli_env()):
        helped = warm_cli.run_warm(["--help"], env, 60)
        assert helped.returncode == 0 and "usage: plait-train" in helped.stdout
    assert len(warm_cli._servers) == 2
