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

RUNS = 22  # lease.sh default: 2 models x 2 masks x 3 plait modes + 2 torchtitan + 4 float8 + 2 chunked + 2 bf16 states


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
    # issue 50's order: what a lease needs first, then the rest
    assert list(stages) == ["setup", "collectives", "suite", "parity", "bench", "gemm", "signature", "varlen",
                            "bench_rest", "plan", "table"]  # fmt: skip
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
    lines = table.splitlines()
    # the training runs' table (the GEMMs' table has rows per config too)
    start = lines.index(lease_table.BENCH_HEADER[0]) + 2
    rows = lines[start : lines.index("", start)]
    assert len(rows) == RUNS
    planned = 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        (config, mask, mode, tps, wall, events, tflops, mfu, mfu_half, of_gemm, gib, planned_gib, planned_ms, host,
         busy, vs_tt, vs_causal) = cells  # fmt: skip
        assert tps.replace(",", "").isdigit() and float(wall) > 0 and float(tflops) > 0 and float(gib) > 0
        assert mfu.endswith("%") and mfu_half.endswith("%") and float(mfu_half[:-1]) < float(mfu[:-1])
        assert of_gemm == "-"  # a dry run's GEMMs (a CPU at 1/64 of the dims) are no peak
        # the samples' profiled step, per step: 101 ms of host work, 308 ms of GPU work (its own
        # launches; not the previous step's tail) for plait; 50 and 268 for torchtitan
        assert (host, busy) == (("50", "268") if "torchtitan" in mode else ("101", "308")), row
        if mode.startswith("plait"):
            assert events == "312.0" and wall == "313.3"  # the samples: CUDA events within 2 % of the wall clock
        planned += planned_gib != "-"
        if planned_gib != "-":  # the dry run plans the first layout: Llama 3 8B dims, causal
            assert (config, mask) == ("llama3-8B", "causal") and float(planned_gib) > 30 and float(planned_ms) > 0
        if mode.startswith("plait") and mask == "causal":
            assert vs_tt == "1.08x"  # the samples: 26,150 / 24,150 tokens/s, the same work (equal_work)
        if mask == "document":
            assert vs_causal == "1.00x"
    assert planned == 3  # eager, compile and CUDA graphs trace one plan; float8 is another layout
    torchtitan = [row for row in rows if "| torchtitan 0.3.0 (compile" in row]
    assert len(torchtitan) == 2 and all("| causal |" in row and "SAC plait's save list" in row for row in torchtitan)


def test_gemm_and_plan_stages_and_the_runs_raw_outputs(dry_run):
    """The lease's figures beyond the runs: the GEMM stage (bf16 GEMMs at the models' shapes, the
    nvidia-smi report: a sample in the dry run), the plan stage (plait-plan for the first layout),
    and each run's raw outputs kept for benchmarks/leases/ (metrics.jsonl, gzipped trace)."""
    stages = {line.split("\t")[0]: line.split("\t")[1] for line in (dry_run / "stages.tsv").read_text().splitlines()}
    assert stages["gemm"] == "0" and stages["plan"] == "0", stages
    gemm = [json.loads(line) for line in (dry_run / "gemm.jsonl").read_text().splitlines()]
    assert [(r["config"], r["gemm"]) for r in gemm][::4] == [("llama3-8B", "FFN up (w1, w3)"),
                                                             ("deepseek-16B", "dense FFN up")]  # fmt: skip
    assert all(r["tflops"] > 0 and r["dry_run"] for r in gemm)
    table = (dry_run / "table.md").read_text()
    assert "- GPU (`nvidia-smi -q`, nvidia-smi.txt): NVIDIA H200, form factor SXM by its 700 W limit" in table
    assert "| llama3-8B | output head | 128 x 64 x 2004 |" in table  # the dry run's dims / 64
    plans = [json.loads(line) for line in (dry_run / "plan.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (dry_run / "bench.jsonl").read_text().splitlines()]
    assert len(plans) == sum(1 for r in records if r["framework"] == "plait")
    assert plans[0]["planned_peak_gib"] > 30 and plans[0]["planned_step_ms"] > 0 and plans[0]["plan_device"] == "h100"
    for r in records:
        assert (dry_run / r["trace_file"]).exists(), r  # every run's profiled step, gzipped
        if r["framework"] == "plait":
            rows = (dry_run / r["metrics_file"]).read_text().splitlines()
            assert len(rows) == 10 and "device_step_s" in json.loads(rows[-1])


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
        # plait's work: causal attention (0.2.2's DeepSeek-V3 defaults to an EOS-split mask), plait's SAC
        assert opts["--attention-mask"] == "causal" and opts["--sac-save"] == "plait"
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


def test_collectives_and_parity_stages_write_their_records(dry_run):
    """The CPU dry run of the lease's first stages: every collective probed (natively, and plait's
    staged point-to-point), and one parity entry run end to end into parity.jsonl."""
    collectives = [json.loads(line) for line in (dry_run / "collectives.jsonl").read_text().splitlines()]
    assert {r["op"] for r in collectives} >= {"all_reduce sum", "broadcast", "all_gather_into_tensor",
                                              "reduce_scatter_tensor sum", "all_to_all_single uneven splits",
                                              "isend / irecv", "send / recv"}  # fmt: skip
    assert all(r["native"] == "ok" and r["device"] == "cpu" for r in collectives), collectives
    assert [r["staged"] for r in collectives if r["staged_by_plait"]] == ["ok", "ok"]
    parity = [json.loads(line) for line in (dry_run / "parity.jsonl").read_text().splitlines()]
    assert [(r["layout"], r["model"], r["dtype"], r["ranks"], r["passed"]) for r in parity] == [
        ("FSDP 2", "llama3", "float32", 2, True)
    ]
    assert parity[0]["max_loss_diff"] <= parity[0]["tolerance"] and parity[0]["host_syncs_per_step"] == 0
