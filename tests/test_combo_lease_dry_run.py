"""The GPU lease cannot break unseen: `bash gpu/lease.sh --dry-run` runs every stage of it on this
CPU but the CUDA work (argument parsing, three wheel folders installed into their target dirs, the
GPU suite collected, the varlen signature, bench_varlen at tiny dims, every benchmark command line
built and checked by plait-train's own parser and validation, the recorded sample outputs read
through the real parsers) and writes the table that a real lease would; benchmarks/gpu.py builds
torchtitan 0.2.2's command lines where the torch predates 0.3.0's; and its bounds stop what they
start. (With gpu/wheels.sh's real .whl, `bash gpu/lease.sh --dry-run` also parses the torchtitan
command lines with torchtitan's own parser.)"""

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import lease_table  # noqa: E402

RUNS = 18  # gpu/lease.sh's default list: 2 models x 2 masks x 3 plait modes + 2 torchtitan + 4 float8


def _wheel(folder: Path, name: str) -> None:
    """A minimal pure-Python wheel: what the lease's setup installs (--no-index, --no-deps) into a
    target dir, here without a registry (the real .whl folder is gpu/wheels.sh's, git-ignored)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-0.0.1.dist-info"
    files = {
        f"{name}.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-0.0.1-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lease")
    wheels = tmp_path_factory.mktemp("whl")
    _wheel(wheels, "plait_lease_probe")
    _wheel(wheels / "torchtitan", "plait_lease_probe_tt")
    _wheel(wheels / "torchtitan-0.2", "plait_lease_probe_tt022")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1", PLAIT_WHEELS=str(wheels))
    proc = subprocess.run(["bash", "gpu/lease.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def test_every_stage_passes(dry_run):
    stages = {line.split("\t")[0]: line.split("\t")[1] for line in (dry_run / "stages.tsv").read_text().splitlines()}
    assert list(stages) == ["setup", "suite", "signature", "varlen", "bench", "table"]
    assert set(stages.values()) == {"0"}, stages
    env = lease_table.read_env(dry_run)
    assert env["dry_run"] == "1" and env["torch"] and env["commit"]
    # the three wheel folders installed, each into a target dir of its own
    sites = [env["plait wheels"], env["torchtitan"], env["torchtitan 0.2"]]
    assert "none" not in sites and len(set(sites)) == 3, sites


def test_table_has_every_run_and_the_ratios(dry_run):
    records = [json.loads(line) for line in (dry_run / "bench.jsonl").read_text().splitlines()]
    assert len(records) == RUNS
    assert [r for r in records if "error" in r] == [], "a command line failed plait's or torchtitan's parser"
    table = (dry_run / "table.md").read_text()
    assert table.startswith("## GPU lease DRY RUN")
    rows = [line for line in table.splitlines() if line.startswith(("| llama3-8B", "| deepseek-16B"))]
    assert len(rows) == RUNS
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        config, mask, mode, tps, mfu, gib, host, busy, vs_tt, vs_causal = cells
        assert tps.replace(",", "").isdigit() and mfu.endswith("%") and float(gib) > 0
        assert float(host) > 0 and float(busy) > 0  # the sample traces' profiled step
        if mode.startswith("plait") and mask == "causal":
            assert vs_tt == "1.08x"  # the samples: 26,150 / 24,150 tokens/s
        if mask == "document":
            assert vs_causal == "1.00x"
    torchtitan = [row for row in rows if "| torchtitan 0.3.0 (compile" in row]
    assert len(torchtitan) == 2 and all("| causal |" in row for row in torchtitan)


def test_table_has_the_suite_the_signature_and_the_attention_rows(dry_run):
    table = (dry_run / "table.md").read_text()
    assert "tests collected" in table  # the suite collected: every GPU test module imports
    assert "Varlen signature (`flash_signature()`): torch " in table
    varlen = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 8 |", "| 64 |"))]
    assert [line.split("|")[2].strip() for line in varlen] == ["one call", "per segment"] * 3
    for row in (json.loads(line) for line in (dry_run / "varlen.jsonl").read_text().splitlines()):
        assert row["max_abs_diff"] < 0.1, row  # bf16: the one call agrees with the per-segment loop


def test_results_refuses_a_dry_run_and_prepends_a_section(dry_run, tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## An older section\n")
    cmd = [sys.executable, str(REPO / "benchmarks" / "lease_table.py"), str(dry_run), "--results", str(results)]
    refused = subprocess.run(cmd, capture_output=True, text=True)
    assert refused.returncode == 2 and results.read_text() == "# Results\n\n## An older section\n"
    subprocess.run([*cmd, "--dry-run-ok", "--commit", "abc123"], check=True, capture_output=True)
    text = results.read_text()
    assert text.startswith("# Results\n\n## GPU lease DRY RUN") and text.endswith("## An older section\n")
    assert "commit abc123" in text


def test_torchtitan_022_command_lines(tmp_path):
    """A torch before 2.12 runs torchtitan 0.2.2: its own CLI (job config by name, --job / --model /
    --profiling sections, no whole-step CUDA graph), the same depth, data, tokenizer and steps; the
    records and the table name 0.2.2."""
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--dry-run", "--no-results",
                           "--profile", "--steps", "3", "--warmup", "1", "--torchtitan-version", "0.2.2",
                           "--runs", "llama3-8B:causal:torchtitan,deepseek-16B:causal:torchtitan", "--json", str(out)],
                          check=True, capture_output=True, text=True, cwd=REPO)  # fmt: skip
    commands = [line.split(": ", 1)[1].split() for line in proc.stdout.splitlines() if " torchtitan: " in line]
    assert len(commands) == 2
    for cmd, (config, layers, seq) in zip(commands, [("llama3_8b", "8", "8192"), ("deepseek_v3_16b", "4", "4096")]):
        opts = dict(zip(cmd, cmd[1:]))
        assert cmd[1].endswith("torchtitan_gpu.py") and opts["--config"] == config and opts["--layers"] == layers
        assert opts["--training.seq_len"] == seq and opts["--training.steps"] == "3"
        assert opts["--training.dataset"] == "c4_test" and opts["--training.dataset_path"].endswith("corpus")
        assert "--job.dump_folder" in opts and "--model.hf_assets_path" in opts
        assert opts["--compile.components"] == "model,loss" and "--compile.enable" in cmd
        assert opts["--profiling.profile_freq"] == "3" and opts["--profiling.save_traces_folder"] == "profiling/traces"
        assert not {"--module", "--dump_folder", "--training.disable_cuda_graphs"} & set(cmd)
    ep = "--parallelism.expert_parallel_degree"
    assert ep in commands[1] and ep not in commands[0]  # DeepSeek-V3 on one GPU: expert parallel 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("torchtitan_version") for r in records] == ["0.2.2", "0.2.2"]
    assert [r for r in records if "error" in r] == []
    assert all("| torchtitan 0.2.2 (compile" in row for row in lease_table.bench_table(records)[2:])


def test_torchtitan_version_fits_the_torch(monkeypatch):
    """0.3.0 where torch.distributed.fsdp has DataParallelMeshDims (torch >= 2.12), else 0.2.2, each
    from its own folder."""
    import argparse

    import torch.distributed.fsdp as fsdp

    import gpu

    args = argparse.Namespace(torchtitan_version="auto", torchtitan_path=Path("/tt030"),
                              torchtitan_022_path=Path("/tt022"))  # fmt: skip
    monkeypatch.setattr(fsdp, "DataParallelMeshDims", object(), raising=False)
    assert gpu.choose_torchtitan(args) == ("0.3.0", Path("/tt030"))
    monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    assert gpu.choose_torchtitan(args) == ("0.2.2", Path("/tt022"))
    args.torchtitan_version = "0.3.0"
    assert gpu.choose_torchtitan(args) == ("0.3.0", Path("/tt030"))


def test_deadline_leaves_runs_unstarted(tmp_path):
    out = tmp_path / "bench.jsonl"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--dry-run", "--no-results",
                    "--steps", "3", "--warmup", "1", "--deadline", "5", "--min-run-s", "40",
                    "--runs", "llama3-8B:causal:compile,llama3-8B:causal:torchtitan", "--json", str(out)],
                   check=True, capture_output=True, cwd=REPO)  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("skipped") for r in records] == [True, True]
    assert "not run" in lease_table.bench_table(records)[2]


def test_a_run_past_its_limit_is_stopped_with_its_children(tmp_path):
    import gpu

    log = tmp_path / "run.log"
    began = time.monotonic()
    rc, timed_out = gpu._run(["bash", "-c", "sleep 60 & echo $!; wait"], dict(os.environ), log, timeout=1)
    assert timed_out and time.monotonic() - began < 20
    child = int(log.read_text().split()[0])
    assert _gone(child), "the grandchild outlived its process group"


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """Dead, or a zombie no one has reaped yet (an orphan's reaper may be slow, or absent in a
    container): either way it runs no more."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False
