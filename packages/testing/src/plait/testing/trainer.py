"""Helpers for tests that run `plait-train` end to end in a subprocess and read its metrics."""

import json
import os
import subprocess
import sys
from pathlib import Path


def cli_env() -> dict[str, str]:
    # Passive OpenMP waiting: on a shared CI box, spinning threads would starve each other.
    return dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")


def run_cli(
    dump: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None, expect: int | None = 0
) -> subprocess.CompletedProcess:
    """`python -m plait.trainer --job.dump_folder DUMP ARGS...`, forked from a warm process where it
    can be (plait.testing.warm_cli). An exit code other than `expect` (None: any) fails with the
    tail of the run's output."""
    from .warm_cli import run_warm

    argv, full_env = ["--job.dump_folder", str(dump), *args], {**cli_env(), **(env or {})}
    result = run_warm(argv, full_env, timeout) or subprocess.run(
        [sys.executable, "-m", "plait.trainer", *argv], capture_output=True, text=True, timeout=timeout, env=full_env
    )
    if expect is not None and result.returncode != expect:
        raise AssertionError(
            f"plait-train exited {result.returncode}, expected {expect}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def start_cli(dump: Path, *args: str, env: dict[str, str] | None = None):
    """`python -m plait.trainer --job.dump_folder DUMP ARGS...` in the background, forked from a warm
    process where it can be (plait.testing.warm_cli): a subprocess.Popen, or a handle with the same
    use (pid, stdout and stderr pipes in text mode, poll, wait, communicate, send_signal, kill)."""
    from .warm_cli import start_warm

    argv, full_env = ["--job.dump_folder", str(dump), *args], {**cli_env(), **(env or {})}
    return start_warm(argv, full_env) or subprocess.Popen(
        [sys.executable, "-m", "plait.trainer", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=full_env,
    )  # fmt: skip


def start_two_ranks(dump: Path, *args: str, until: str, timeout: float = 240) -> subprocess.Popen:
    """`plait-train --nproc-per-node 2` training (for ever) in the background, returned once
    `<dump>/<until>` exists (a checkpoint folder, metrics.jsonl): the moment a test acts on it."""
    import time

    proc = start_cli(dump, *args, "--nproc-per-node", "2", "--training.local_batch_size", "1", "--training.steps",
                     "100000")  # fmt: skip
    deadline = time.monotonic() + timeout
    while not (Path(dump) / until).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"plait-train never wrote {until}:\n{proc.communicate()[1][-2000:]}")
        time.sleep(0.5)
    return proc


def rank_pids(launcher: int) -> dict[int, int]:
    """{RANK: pid} of a launcher's rank processes: its descendants named `plait-rank<RANK>` (the
    name plait-train gives a rank: a rank forked by plait-train's launcher shows the launcher's
    environment and command line in /proc), else by RANK in the environment (a rank that has not
    named itself yet, or a rank's stand-in: rank_client.py)."""
    found = {}  # pid -> (parent, name, RANK in the environment)
    for child in Path("/proc").glob("[0-9]*"):
        try:
            stat = (child / "stat").read_text()
            environ = (child / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
        found[int(child.name)] = (int(rest.split()[1]), name, rank)

    def depth(pid: int) -> int | None:  # generations below the launcher
        for generation in range(1, 8):
            pid = found.get(pid, (0,))[0]
            if pid == launcher:
                return generation
        return None

    ranks: dict[int, tuple] = {}
    for pid, (_, name, environ_rank) in found.items():
        named = name.startswith("plait-rank") and name[10:].isdigit()
        rank = int(name[10:]) if named else environ_rank
        below = depth(pid)
        if rank is None or below is None:
            continue
        # A named rank before a stand-in; a rank before its own children (which inherit its name).
        key = (not named, below)
        if rank not in ranks or key < ranks[rank][0]:
            ranks[rank] = (key, pid)
    return {rank: pid for rank, (_, pid) in sorted(ranks.items())}


def parity_args(steps: int = 4, seq_len: int = 64, lr: float = 3e-3) -> list[str]:
    """CLI arguments for runs whose losses are compared step for step across layouts: fp32,
    deterministic, a short warmup, one metrics row per step at the end."""
    # fmt: off
    return [
        "--training.steps", str(steps),
        "--training.seq_len", str(seq_len),
        "--training.dtype", "float32",
        "--training.deterministic", "true",
        "--lr_scheduler.warmup_steps", "2",
        "--optimizer.lr", str(lr),
        "--metrics.log_freq", str(steps),
        "--metrics.cpu_peak_tflops", "0.1",
    ]
    # fmt: on


def read_metrics(dump: Path) -> list[dict]:
    """One dict per line of `<dump>/metrics.jsonl`."""
    return [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


def training_rows(dump: Path) -> list[dict]:
    """The training steps' rows of `<dump>/metrics.jsonl` (validation rows have no "loss")."""
    return [row for row in read_metrics(dump) if "loss" in row]


def losses(dump: Path) -> list[float]:
    return [row["loss"] for row in training_rows(dump)]


def train_in_process(dump: Path, *args: str, sentinel=None) -> list[dict]:
    """Train in this process (`args` as for plait-train, without --nproc-per-node), entering
    `sentinel` (a plait.testing.sentinel.StepSentinel) around every step; return the training
    steps' metrics rows (rank 0; other ranks get []). Under plait.testing.run_on_ranks every rank
    calls it: the process group is the caller's. Global torch settings the run changes are put back."""
    import torch

    from plait.trainer.cli import DEFAULT_CONFIG, parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.train import Trainer

    parsed = parse_args(["--job.dump_folder", str(dump), *args])
    config = build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        trainer = Trainer(config)
        trainer.step_sentinel = sentinel
        code = 1
        try:
            trainer.train()
            code = 0
        finally:
            trainer.release(code)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return training_rows(dump) if trainer.rank == 0 else []


def _sentinel_rank(rank: int, world_size: int, dump: str, args: list[str]):
    from plait.testing.sentinel import StepSentinel

    sentinel = StepSentinel()
    rows = train_in_process(Path(dump), *args, sentinel=sentinel)
    return rows, sentinel.step_counts(), sentinel.report()


def train_with_sentinel(dump: Path, nproc: int, *args: str, timeout: float = 300) -> tuple[list[dict], list, list[str]]:
    """Train on `nproc` CPU ranks (plait.testing.run_on_ranks, gloo; also for 1 rank, so the
    caller's process keeps its settings) with a step sentinel on every rank. Returns rank 0's
    metrics rows (with `host_syncs` and `precondition_violations`), every rank's
    `step_counts()` and every rank's `report()`."""
    from plait.testing import run_on_ranks

    results = run_on_ranks(_sentinel_rank, nproc, str(dump), list(args), timeout=timeout)
    return results[0][0], [r[1] for r in results], [r[2] for r in results]
