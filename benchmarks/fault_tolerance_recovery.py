"""What a lost replica group costs (issue 51): two plait-train groups of one rank on this machine, a
torchft lighthouse process; group 1 SIGKILLs itself at step K and is started again (a fresh
plait-train, as a scheduler would) after `--restart-after` seconds.

Measured from the groups' own output and metrics.jsonl:
- the survivor's steps lost: the steps it ran that were committed nowhere (each is run again on the
  next batch; its batch is skipped), and whether it restarted or read a checkpoint (it must not);
- the steps it took alone (quorum 1) while group 1 was away;
- the rejoining group: the step whose live state it took, and the steps it then spent catching up
  (0: it takes the state inside the quorum and steps with the others).

    python benchmarks/fault_tolerance_recovery.py [--steps 300] [--kill-at 20] [--restart-after 3]
        [--results benchmarks/RESULTS.md | --no-results]
"""

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.n_layers", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.log_freq", "10", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(dump: Path, address: str, replica: int, steps: int, env: dict) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "plait-train"), *TINY, "--training.steps", str(steps),
           "--job.dump_folder", str(dump), "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
           "--fault_tolerance.replica_id", str(replica), "--fault_tolerance.lighthouse", address]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def measure(steps: int, kill_at: int, restart_after: float) -> dict:
    port = _free_port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}",
                                   "--min_replicas", "1", "--heartbeat_timeout_ms", "1000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    address = f"http://localhost:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    dump = Path(tempfile.mkdtemp(prefix="ft-recovery-"))
    try:
        survivor = _group(dump, address, 0, steps, env)
        doomed = _group(dump, address, 1, steps, {**env, "PLAIT_TEST_FAULT": f"{kill_at}:kill"})
        doomed.communicate(timeout=600)
        died = time.monotonic()
        time.sleep(restart_after)
        started = time.monotonic()
        rejoined = _group(dump, address, 1, steps, env)
        survivor_out, _ = survivor.communicate(timeout=900)
        rejoined_out, _ = rejoined.communicate(timeout=900)
        ended = time.monotonic()
    finally:
        lighthouse.kill()
    rows = [json.loads(line) for line in (dump / "replica_0" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    joined_at = int(rejoined_out.split("took the live state of step ")[1].split()[0])
    rejoin_rows = [json.loads(line) for line in (dump / "replica_1" / "metrics.jsonl").read_text().splitlines()]
    step_s = sum(r["step_time_s"] for r in train) / len(train)
    return {
        "steps": steps, "killed_at": kill_at, "restart_after_s": restart_after,
        "exit_codes": (survivor.returncode, rejoined.returncode),
        "survivor_uncommitted": survivor_out.count("was not committed"),
        "survivor_restarted_or_resumed": "resuming" in survivor_out,
        "steps_alone": sum(1 for r in train if r.get("quorum") == 1),
        "joined_at": joined_at,
        "catch_up_steps": min(r["step"] for r in rejoin_rows if "loss" in r) - joined_at - 1,
        "mean_step_s": step_s, "down_s": started - died, "total_s": ended - died,
    }  # fmt: skip


def _table(r: dict, commit: str) -> str:
    return "\n".join([
        f"## Fault tolerance: what a lost replica group costs, {datetime.date.today()} (issue 51; CPU, {commit})",
        "",
        f"Two plait-train groups of one rank each (Llama 3 debug, 1 layer, seq 64, batch 2; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}), a "
        f"`torchft_lighthouse` process (heartbeat timeout 1 s). Group 1 SIGKILLs itself at step {r['killed_at']} and "
        f"a fresh `plait-train` for it starts {r['restart_after_s']:g} s later. "
        "`python benchmarks/fault_tolerance_recovery.py`.",
        "",
        "| what | measured |",
        "|---|---|",
        f"| survivor: steps lost | 0 ({r['survivor_uncommitted']} step committed nowhere and run again on the next "
        f"batch; that batch is skipped); restarted or read a checkpoint: {'yes' if r['survivor_restarted_or_resumed'] else 'no'} |",
        f"| survivor: steps alone (quorum 1) | {r['steps_alone']} |",
        f"| rejoining group | took the live state of step {r['joined_at']}, then stepped with the survivor: "
        f"{r['catch_up_steps']} steps spent catching up |",
        f"| away | {r['down_s']:.1f} s from the kill to the restart's start; mean step {r['mean_step_s'] * 1000:.0f} ms, "
        f"so ~{r['steps_alone'] * r['mean_step_s']:.0f} s alone: the wait, then a fresh plait-train's start (imports, "
        "model build) and its entry into the next quorum |",
        f"| exit codes | survivor {r['exit_codes'][0]}, rejoined group {r['exit_codes'][1]} |",
        "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--restart-after", type=float, default=3.0)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    result = measure(args.steps, args.kill_at, args.restart_after)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    section = _table(result, commit)
    print(section)
    if not args.no_results:
        path = Path(args.results)
        text = path.read_text()
        title, _, rest = text.partition("\n\n")  # newest first, under the title
        path.write_text(f"{title}\n\n{section}\n{rest}")


if __name__ == "__main__":
    main()
