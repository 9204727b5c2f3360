"""plait-train as replica groups (fault_tolerance.enable, issue 51): each group is its own
plait-train, a torchft lighthouse in this process. Groups run concurrently, each forked from the
warm plait-train server (plait.testing.warm_cli) in a thread of its own."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plait.testing.trainer import parity_args, read_metrics, run_cli, training_rows
from plait.trainer import exit_codes
from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate

ft = pytest.importorskip("plait.faulttolerance")

TINY = ["--model.n_layers", "1", "--training.local_batch_size", "2", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false"]  # fmt: skip
# Every group validates on the same batches: equal val_loss means equal weights.
VALIDATE_AT_END = ["--data.val_dataset", "builtin", "--data.val_steps", "1"]


def _group(lighthouse, i: int, *more: str) -> list[str]:
    return ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(i),
            "--fault_tolerance.lighthouse", lighthouse, "--fault_tolerance.quorum_timeout_s", "60", *more]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _concurrently(*runs):
    """Run each callable in a thread of its own; their results, in order (a failure re-raised)."""
    results, errors = [None] * len(runs), []

    def one(k, run):
        try:
            results[k] = run()
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k, run)) for k, run in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _val_loss(dump) -> float:
    return [r["val_loss"] for r in read_metrics(dump) if "val_loss" in r][-1]


def _groups_against_hsdp(tmp_path, address: str, ranks_per_group: int, steps: int = 4) -> None:
    """2 groups of `ranks_per_group` ranks (FSDP inside a group of 2) against HSDP 2 x that, fp32:
    each step's mean loss and the gradient norm are HSDP's; every row logs a quorum of 2; both
    groups end with the same weights (the same val_loss); replica 0 writes the checkpoints."""
    args = [*TINY, *parity_args(steps), "--metrics.log_freq", "1", *VALIDATE_AT_END, "--data.val_interval", str(steps)]
    ranks = ["--nproc-per-node", str(ranks_per_group)] if ranks_per_group > 1 else []
    _concurrently(
        *[lambda i=i: run_cli(tmp_path / "ft", *args, *ranks, *_group(address, i, "--fault_tolerance.min_replicas", "2"),
                              "--checkpoint.enable", "--checkpoint.interval", "2") for i in range(2)],
        lambda: run_cli(tmp_path / "hsdp", *args, "--nproc-per-node", str(2 * ranks_per_group),
                        "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", str(ranks_per_group)),
    )  # fmt: skip
    groups = [training_rows(tmp_path / "ft" / f"replica_{i}") for i in range(2)]
    hsdp = training_rows(tmp_path / "hsdp")
    assert [r["step"] for r in groups[0]] == [r["step"] for r in groups[1]] == list(range(1, steps + 1))
    for g0, g1, ref in zip(*groups, hsdp):
        assert abs((g0["loss"] + g1["loss"]) / 2 - ref["loss"]) < 1e-5, (g0, g1, ref)
        assert abs(g0["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"] and g0["grad_norm"] == g1["grad_norm"]
        assert g0["quorum"] == g1["quorum"] == 2
    assert _val_loss(tmp_path / "ft" / "replica_0") == _val_loss(tmp_path / "ft" / "replica_1")
    assert sorted(p.name for p in (tmp_path / "ft" / "replica_0" / "checkpoints").glob("step-*")) == [
        "step-000002", "step-000004"]  # fmt: skip
    assert not list((tmp_path / "ft" / "replica_1").glob("checkpoints/step-*"))


@pytest.mark.timeout(300)
def test_two_groups_step_like_hsdp_and_only_the_first_saves(tmp_path):
    """2 groups x 1 rank against HSDP 2 x 1, and 2 groups x FSDP 2 against HSDP 2 x 2 (the live
    state of step 0 travels as FSDP's DTensor shards, rank to rank). Then DiLoCo: the groups step
    alone on their own data and agree after the last sync."""
    lighthouse = ft.start_lighthouse(min_replicas=2)
    try:
        address = lighthouse.address()
        _groups_against_hsdp(tmp_path / "one_rank", address, ranks_per_group=1)
        _groups_against_hsdp(tmp_path / "fsdp", address, ranks_per_group=2)
        diloco = [*TINY, *parity_args(4), "--data.val_interval", "4", *VALIDATE_AT_END]
        _concurrently(*[lambda i=i: run_cli(
            tmp_path / "diloco", *diloco, *_group(address, i, "--fault_tolerance.semi_sync", "diloco",
                                                  "--fault_tolerance.sync_steps", "2")) for i in range(2)])  # fmt: skip
        rows = [training_rows(tmp_path / "diloco" / f"replica_{i}") for i in range(2)]
        assert all(len(r) == 4 for r in rows) and rows[0][0]["loss"] != rows[1][0]["loss"]  # each its own data
        assert _val_loss(tmp_path / "diloco" / "replica_0") == _val_loss(tmp_path / "diloco" / "replica_1")
    finally:
        lighthouse.shutdown()


@pytest.mark.timeout(300)
def test_a_killed_group_is_dropped_then_rejoins_with_the_live_state(tmp_path):
    """Group 1 is SIGKILLed at step 4: group 0 keeps stepping in the same process, without a
    checkpoint read; the step that lost the group is committed nowhere and runs again on the next
    batch (each step once in metrics.jsonl); it logs a quorum of 1. Group 1, started again, takes
    the live state (no checkpoint read), and both groups end with the same weights."""
    # Group 0's steps take ~0.1 s: 150 of them outlast group 1's death, the heartbeat timeout and
    # its warm restart (~3 s), whatever the machine's load (a slower machine only widens the margin).
    steps, killed_at = 150, 4
    args = [*TINY, "--training.seq_len", "64", "--training.steps", str(steps), "--metrics.log_freq", "10",
            "--checkpoint.enable", "--checkpoint.interval", "50", *VALIDATE_AT_END, "--data.val_interval", str(steps)]  # fmt: skip
    lighthouse = ft.start_lighthouse(min_replicas=1, heartbeat_timeout_ms=1000)
    try:
        address = lighthouse.address()

        def group1():
            killed = run_cli(tmp_path, *args, *_group(address, 1), env={"PLAIT_TEST_FAULT": f"{killed_at}:kill"},
                             expect=None)
            time.sleep(2)  # past the lighthouse's heartbeat timeout: group 0 steps alone meanwhile
            return killed, run_cli(tmp_path, *args, *_group(address, 1))

        survivor, (killed, rejoined) = _concurrently(lambda: run_cli(tmp_path, *args, *_group(address, 0)), group1)
    finally:
        lighthouse.shutdown()
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "resuming" not in survivor.stdout + survivor.stderr
    assert f"fault tolerance: step {killed_at} was not committed" in survivor.stdout + survivor.stderr
    rows = training_rows(tmp_path / "replica_0")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    quorums = [r["quorum"] for r in rows]
    assert quorums[: killed_at - 1] == [2] * (killed_at - 1) and 1 in quorums and quorums[-1] == 2, quorums
    out = rejoined.stdout + rejoined.stderr
    assert "took the live state of step" in out and "resuming" not in out
    joined_at = int(out.split("took the live state of step ")[1].split()[0])
    assert killed_at <= joined_at < steps
    assert [r["step"] for r in training_rows(tmp_path / "replica_1")][-(steps - joined_at):] == list(range(joined_at + 1, steps + 1))
    assert _val_loss(tmp_path / "replica_0") == _val_loss(tmp_path / "replica_1")


@pytest.mark.timeout(180)
def test_a_lighthouse_absent_or_lost_is_one_line_and_exit_74(tmp_path):
    """No lighthouse at the address: exit 74 (requeue), one line naming it. A lighthouse that
    dies while the group trains: the same, at the next step's quorum."""
    quick = ["--fault_tolerance.quorum_timeout_s", "3"]
    result = run_cli(tmp_path / "absent", *TINY, "--training.steps", "2", *_group("http://127.0.0.1:9", 0, *quick),
                     expect=exit_codes.INFRA)  # fmt: skip
    last = result.stderr.strip().splitlines()[-1]
    assert "http://127.0.0.1:9" in last and "lighthouse" in last, last

    # A lighthouse process (the in-process one keeps serving its open connections after shutdown()).
    port = _free_port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}",
                                   "--min_replicas", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    address = f"http://localhost:{port}"
    dump = tmp_path / "lost"
    run = threading.Thread(target=lambda: results.append(run_cli(
        dump, *TINY, "--training.steps", "100000", *_group(address, 0, *quick), expect=None)))  # fmt: skip
    results = []
    run.start()
    deadline = time.monotonic() + 120
    while not (dump / "replica_0" / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    lighthouse.kill()
    lighthouse.wait()
    run.join(timeout=120)
    assert results and results[0].returncode == exit_codes.INFRA, results and results[0].stderr[-2000:]
    last = results[0].stderr.strip().splitlines()[-1]
    assert address in last and "lighthouse" in last, last


@pytest.mark.parametrize("overrides, message", [
    (["--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id = 2 must be in [0, group_size = 2)"),
    (["--parallelism.dp_replicate", "2"], "parallelism.dp_replicate = 2 with fault_tolerance.enable"),
    (["--fault_tolerance.lighthouse", ""], "fault_tolerance.lighthouse is not set"),
    (["--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_steps", "0"], "fault_tolerance.sync_steps = 0"),
])  # fmt: skip
def test_settings_that_cannot_run_are_refused_before_anything_starts(overrides, message, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    argv = [*_group("http://127.0.0.1:29510", 0), *overrides]
    config = build_config(None, _pairs(argv))
    with pytest.raises(ConfigError) as refused:
        validate(config, world_size=2)
    assert message in str(refused.value)
    assert Path(config.job.dump_folder).name.startswith("replica_")  # each group its own folder


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    """`--section.key value` pairs (a bare boolean flag is true), as the CLI parses them."""
    from plait.trainer.cli import parse_args

    return parse_args(argv).overrides


README = Path(__file__).parents[1] / "README.md"


def _readme_block(marker: str) -> str:
    import re

    return next(b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if marker in b)


@pytest.mark.timeout(300)
def test_the_one_machine_recipe_runs_as_printed(tmp_path):
    """The README's two groups on one machine, on this CPU: one rank a group and a tiny model
    instead of four GPUs and Llama 3 8B, a free port instead of 29510; the rest as printed."""
    from plait.testing.trainer import cli_env

    port = _free_port()
    tiny = " ".join([*TINY, "--training.steps", "3", "--training.seq_len", "64"])
    script = (_readme_block("torchft_lighthouse --bind").replace("--nproc-per-node 4", "--nproc-per-node 1")
              .replace("--config llama3_8B.toml", tiny).replace("29510", str(port)))  # fmt: skip
    env = {**cli_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, timeout=240, capture_output=True, text=True)
    out = f"exit {ran.returncode}\n{ran.stdout[-3000:]}\n{ran.stderr[-6000:]}"
    assert ran.returncode == 0, out
    groups = [tmp_path / "runs" / "llama3-8b-ft" / f"replica_{i}" for i in range(2)]
    rows = [training_rows(group) for group in groups]
    for group, group_rows in zip(groups, rows):
        status = group / "exit_status"
        assert status.is_file() and status.read_text().strip() == "0", f"{group.name}: {out}"
        # min_replicas 1: a group that starts seconds before the other steps alone (quorum 1), and
        # one that joins later takes its state (its first rows are the steps it took the state of)
        steps = [r["step"] for r in group_rows]
        assert steps[-1] == 3 and steps == sorted(set(steps)) and all(r["quorum"] in (1, 2) for r in group_rows)
    together = {r["step"]: r["grad_norm"] for r in rows[0] if r["quorum"] == 2}
    for r in rows[1]:  # a step the two took together: one averaged gradient, one norm
        if r["quorum"] == 2 and r["step"] in together:
            assert r["grad_norm"] == together[r["step"]], (r, together)


def test_the_slurm_recipe_restarts_a_group_that_can_resume(tmp_path):
    """The README's SLURM script with srun, scontrol and sleep stubbed: each group runs on its own
    nodes, and a group whose exit_status is 74 is started again, once, until it finishes."""
    stubs = r'''
scontrol() { printf 'n1\nn2\nn3\nn4\n'; }
sleep() { :; }
srun() {
  case "$*" in *torchft_lighthouse*) echo "lighthouse $*" >> calls; return 0 ;; esac
  local all="$*"; local id=${all##*replica_id } nodes=${all##*-w }; id=${id%% *} nodes=${nodes%% *}
  echo "group $id $nodes" >> calls
  mkdir -p runs/llama3-70b-ft/replica_$id
  # the first run of each group: a lost node (74); the second finishes
  if [ -f ran_$id ]; then echo 0; else touch ran_$id; echo 74; fi > runs/llama3-70b-ft/replica_$id/exit_status
}
SLURM_JOB_NODELIST=n[1-4]
'''
    script = stubs + _readme_block("#SBATCH --nodes=4 --ntasks-per-node=1")
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=30)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("lighthouse") and "-w n1" in calls[0]
    assert sorted(calls[1:]) == ["group 0 n1,n2", "group 0 n1,n2", "group 1 n3,n4", "group 1 n3,n4"], calls
