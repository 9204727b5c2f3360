"""The GPU lease's figures, checked on hand-made inputs (no GPU, no lease): the per-step profile
arithmetic on a synthetic Chrome trace, MFU in both attention conventions, the wall-clock and
CUDA-event step times, the tables (training runs, CUDA parity, GEMMs, nvidia-smi), plait-plan once
per layout, torchtitan run with plait's selective-AC save list, and a lease's outputs archived
into benchmarks/leases/<date>-<commit>/."""

import argparse
import gzip
import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_common  # noqa: E402
import lease_archive  # noqa: E402
import lease_machine  # noqa: E402
import lease_plan  # noqa: E402
import lease_table  # noqa: E402
import profile_summary  # noqa: E402
import torchtitan_gpu  # noqa: E402

SAMPLES = REPO / "benchmarks" / "lease_samples"


def _x(cat: str, name: str, ts: int, dur: int, tid: int = 1, corr: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat in ("kernel", "gpu_memcpy", "gpu_memset") else 1,
             "tid": tid, "ts": ts, "dur": dur}  # fmt: skip
    return {**event, "args": {"correlation": corr}} if corr is not None else event


# Two profiled steps (µs). Step 1 opens waiting for the previous step (a copy and two syncs, on two
# threads, overlapping), then launches from the main and the backward thread; step 2's last kernel
# runs after its span ends. A kernel launched before step 1 and the device timeline's copy of the
# ProfilerStep span belong to no step.
TRACE = [
    _x("user_annotation", "ProfilerStep#1", 0, 1000),
    _x("user_annotation", "ProfilerStep#2", 1000, 800),
    _x("gpu_user_annotation", "ProfilerStep#1", 0, 5000, tid=7),
    _x("cuda_runtime", "cudaLaunchKernel", -100, 5, corr=1),
    _x("kernel", "previous_step_gemm", 0, 300, tid=7, corr=1),
    _x("cuda_runtime", "cudaMemcpyAsync", 10, 290, corr=2),
    _x("gpu_memcpy", "Memcpy DtoH", 295, 5, tid=7, corr=2),
    _x("cuda_runtime", "cudaStreamSynchronize", 300, 20),
    _x("cuda_runtime", "cudaStreamSynchronize", 310, 40, tid=2),
    _x("cuda_runtime", "cudaLaunchKernel", 400, 5, corr=3),
    _x("kernel", "gemm", 400, 300, tid=7, corr=3),
    _x("cuda_driver", "cuLaunchKernel", 450, 5, tid=2, corr=4),
    _x("kernel", "triton_fused", 650, 250, tid=8, corr=4),
    _x("cuda_runtime", "cudaMemsetAsync", 500, 5, corr=5),
    _x("gpu_memset", "Memset", 950, 10, tid=7, corr=5),
    _x("cuda_runtime", "cudaLaunchKernel", 1100, 5, corr=6),
    _x("kernel", "gemm", 1200, 400, tid=7, corr=6),
    _x("cuda_runtime", "cudaLaunchKernel", 1150, 5, corr=7),
    _x("kernel", "flash_bwd", 1700, 400, tid=7, corr=7),
    _x("cuda_runtime", "cudaMemcpyAsync", 1200, 100, corr=8),
    _x("gpu_memcpy", "Memcpy DtoH", 2100, 10, tid=7, corr=8),
]


def test_step_profile_is_per_step(tmp_path):
    """Step 1: span 1000, waits 10-350 (a copy, then two syncs overlapping across threads: 340),
    GPU work 5 + 400-900 (two kernels overlapping: 500) + 10 = 515 over 295-960. Step 2: span 800,
    a 100 copy, GPU work 400 + 400 + 10 = 810 over 1200-2110. Averaged, in ms."""
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    p = profile_summary.step_profile(path)
    expected = {"host_span_ms": 0.9, "host_wait_ms": 0.22, "host_launch_ms": 0.68, "gpu_busy_ms": 0.6625,
                "gpu_span_ms": 0.7875, "device_events": 3.5, "steps": 2}  # fmt: skip
    assert {k: p[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert dict(p["top_kernels"]) == pytest.approx({"gemm": 0.35, "flash_bwd": 0.2, "triton_fused": 0.125,
                                                    "Memcpy DtoH": 0.0075, "Memset": 0.005})  # fmt: skip
    cpu_only = tmp_path / "cpu.json"
    cpu_only.write_text(json.dumps({"traceEvents": [e for e in TRACE if e["cat"] == "user_annotation"]}))
    assert profile_summary.step_profile(cpu_only) is None


def test_mfu_in_both_conventions_and_the_step_clocks():
    record = {"tokens_per_second": 1000.0}
    figures = gpu_common.throughput_figures(record, {"flops_per_token": 6e9, "attention_flops_per_token": 2e9}, 1000.0)
    assert figures["tflops"] == pytest.approx(6.0)
    assert figures["mfu_attn_whole"] == pytest.approx(0.006) and figures["mfu_attn_half"] == pytest.approx(0.005)
    rows = [{"step_time_s": s, "device_step_s": d} for s, d in ((0.30, 0.297), (0.31, 0.306), (0.50, 0.49))]
    times = gpu_common.step_times(rows)
    assert times["step_ms_wall"] == pytest.approx(310) and times["step_ms_events"] == pytest.approx(306)
    assert times["events_vs_wall"] == pytest.approx(306 / 310)
    assert "step_ms_events" not in gpu_common.step_times([{"step_time_s": 0.3}])  # a CPU run: no events


def test_flops_per_token_from_plaits_own_config():
    """The FLOPs both frameworks' MFU columns use: the model's flops_per_token at the run's depth and
    sequence, and its attention term (12 L H A S for Llama; 6 L H (qk + v) S for MLA)."""
    import gpu

    args = argparse.Namespace(layers_8b=8, layers_16b=4, batch_16b=1, steps=10, profile=False)
    llama = gpu_common.model_flops(gpu.plait_command("llama3-8B", args, Path("unused"), "compile", "causal"))
    assert llama["attention_flops_per_token"] == 12 * 8 * 32 * 128 * 8192
    assert llama["flops_per_token"] * 8192 == pytest.approx(1.380e14, rel=1e-3)  # plait-plan's 8B x 8 layers step
    ds = gpu_common.model_flops(gpu.plait_command("deepseek-16B", args, Path("unused"), "compile", "causal"))
    assert ds["attention_flops_per_token"] == 6 * 4 * 16 * (192 + 128) * 4096


def _run(mode: str, **figures) -> dict:
    return {"config": "llama3-8B", "mask": "causal", "mode": mode, "tokens_per_second": 30000.0, "step_ms_wall": 273.0,
            "memory_gib": 44.0, "mfu": 0.5, **figures}  # fmt: skip


def test_bench_table_columns():
    plait = _run("compile", step_ms_events=260.0, events_vs_wall=260 / 273, tflops=500.0, mfu_attn_whole=0.5056,
                 mfu_attn_half=0.457, profile={"host_launch_ms": 61.2, "gpu_busy_ms": 270.4})  # fmt: skip
    titan = _run("torchtitan", tokens_per_second=25000.0, torchtitan_version="0.2.2", equal_work=False,
                 tt_mode="compile; attention flex block_causal")  # fmt: skip
    old = {**_run("eager"), "busy": {"host_step_ms": 255.0, "device_busy_ms": 455.0}}  # before per-step profiles
    plans = [{"config": "llama3-8B", "mask": "causal", "mode": "compile", "planned_peak_gib": 43.7,
              "planned_step_ms": 139.5}]  # fmt: skip
    gemm = [{"config": "llama3-8B", "gemm": "output head", "tflops": 750.0, "dry_run": False}]
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in lease_table.bench_table([plait, titan, old], plans, gemm)[2:]}  # fmt: skip
    assert rows["plait compile"][3:] == ["30,000", "273.0", "260.0 (0.952x wall!)", "500", "50.6%", "45.7%", "67%",
                                         "44.0", "43.7", "140", "61", "270", "", ""]  # fmt: skip
    assert rows["plait eager"][13:15] == ["-", "-"]  # the old columns were not per step: not shown
    titan_row = next(cells for label, cells in rows.items() if label.startswith("torchtitan"))
    assert "not plait's work: no ratio" in titan_row[2]
    titan["equal_work"] = True
    ratio = lease_table.bench_table([plait, titan])[2].split("|")[-3].strip()
    assert ratio == "1.20x"


def test_parity_table_and_machine_lines(tmp_path):
    parity = lease_table.read_jsonl(SAMPLES / "parity.jsonl")
    lines = lease_table.parity_table(parity)
    assert lines[2] == "| fsdp2 | llama3 | float32 | 2 | 2.40e-07 | 3.10e-07 | 0 (0) | yes |"
    assert lines[4].endswith("| 2 (1) | NO |")
    (tmp_path / "parity.jsonl").write_text((SAMPLES / "parity.jsonl").read_text())
    assert "2 of 3 entries passed" in lease_table._parity_parts(tmp_path)[1]
    text = (f"# nvidia-smi -q, idle\n{(SAMPLES / 'nvidia-smi.txt').read_text()}\n"
            f"# nvidia-smi -q -d CLOCK,POWER, under load\n{(SAMPLES / 'nvidia-smi-load.txt').read_text()}")  # fmt: skip
    s = lease_machine.smi_summary(text)
    clocks = (s["product"], s["power_limit_w"], s["max_sm_clock_mhz"], s["load_sm_clock_mhz"])
    assert clocks == ("NVIDIA H200", 700, 1980, 1755)
    assert s["form_factor"] == "SXM by its 700 W limit" and s["load_reasons"] == ["SW Power Cap"]
    assert s["load_power_w"] == 655.1 and s["load_pstate"] == "P0"


def test_one_plan_per_layout(tmp_path, monkeypatch):
    """eager / compile / CUDA graphs trace one eager step: one plan; float8 is another; torchtitan none."""

    def record(mode: str, extra: tuple = ()) -> dict:
        flags = {
            "eager": ["--training.compile", "false"],
            "compile": ["--training.compile", "true"],
            "cudagraphs": ["--training.compile", "true", "--training.compile_mode", "reduce-overhead"],
        }
        args = ["--config", "llama3_8B.toml", *flags.get(mode, flags["compile"]), *extra,
                "--metrics.profile_interval", "10"]  # fmt: skip
        return {"config": "llama3-8B", "mask": "causal", "mode": mode, "plait_args": args}

    records = [record("compile"), record("eager"), record("cudagraphs"),
               record("float8rw", ("--training.float8", "rowwise")), _run("torchtitan")]  # fmt: skip
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "env.txt").write_text("gpu: NVIDIA H200, 143771 MiB, 580.159.04\n")
    planned = []
    monkeypatch.setattr(lease_plan, "plan_one", lambda args, device, timeout: planned.append((args, device)) or
                        {"planned_peak_gib": 40.0 + len(planned)})  # fmt: skip
    plans = lease_plan.plan_lease(tmp_path, deadline=60, jobs=1, device=None, dry_run=False)
    assert len(planned) == 2 and {device for _, device in planned} == {"h200"}
    assert [p["mode"] for p in plans] == ["compile", "eager", "cudagraphs", "float8rw"]
    assert (
        len({p["planned_peak_gib"] for p in plans[:3]}) == 1
        and plans[3]["planned_peak_gib"] != plans[0]["planned_peak_gib"]
    )


def test_torchtitan_saves_what_plait_saves(monkeypatch):
    """torchtitan_gpu.py's copy of plait's selective-AC save list is plait's, and its patch makes
    torchtitan's policy save every op of it (asking torchtitan's policy first), nothing else changed."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from plait.trainer.activation_checkpoint import _SAVE_OPS

    assert {str(op) for op in _SAVE_OPS if not str(op).startswith("plait.")} == set(torchtitan_gpu.PLAIT_SAVE_OPS)
    # what the patch wraps, here the policy itself: torch's (0.2.2 imports it when it applies SAC)
    # and the module's own name for it (0.3.0 imports it at the top)
    monkeypatch.setattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts", lambda policy: policy)
    ac = types.ModuleType("torchtitan.distributed.activation_checkpoint")
    ac.create_selective_checkpoint_contexts = lambda policy: policy
    titan, distributed = types.ModuleType("torchtitan"), types.ModuleType("torchtitan.distributed")
    titan.distributed, distributed.activation_checkpoint = distributed, ac
    for name, module in (("torchtitan", titan), ("torchtitan.distributed", distributed),
                         ("torchtitan.distributed.activation_checkpoint", ac)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    asked = []

    def every_second_mm(ctx, func, *args, **kwargs):  # torchtitan's rule, in short
        asked.append(func)
        return CheckpointPolicy.PREFER_RECOMPUTE

    torchtitan_gpu.save_like_plait()
    for make in (torch.utils.checkpoint.create_selective_checkpoint_contexts, ac.create_selective_checkpoint_contexts):
        policy = make(every_second_mm)
        assert policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
        assert policy(None, torch.ops.aten._grouped_mm.default) == CheckpointPolicy.MUST_SAVE
        assert policy(None, torch.ops.aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    assert len(asked) == 6


def test_archive_a_lease(tmp_path):
    out = tmp_path / "files_at"
    (out / "runs").mkdir(parents=True)
    (out / "env.txt").write_text("date: 2026-11-29 10:00 UTC\ndry_run: 0\ngpu: NVIDIA H200\ncommit: 0123456789ab\n")
    (out / "stages.tsv").write_text("setup\t0\t2\t360\nbench\t0\t200\t300\n")
    (out / "bench.jsonl").write_text(json.dumps(_run("compile")) + "\n")
    (out / "parity.jsonl").write_text((SAMPLES / "parity.jsonl").read_text())
    (out / "runs" / "llama3-8B-causal-compile.metrics.jsonl").write_text('{"step": 1}\n')
    (out / "runs" / "llama3-8B-causal-compile.trace.json").write_text(json.dumps({"traceEvents": TRACE}))
    with gzip.open(out / "runs" / "tt-llama3-8B.trace.json.gz", "wb", compresslevel=0) as f:
        f.write(bytes(range(256)) * 400)  # ~100 KB, over the limit below
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Older\n")
    argv = [str(out), "--dest", str(tmp_path / "leases"), "--max-trace-mb", "0.05", "--results", str(results)]
    assert lease_archive.main(argv) == 0
    dest = tmp_path / "leases" / "2026-11-29-0123456789ab"
    manifest = (dest / "MANIFEST.txt").read_text()
    run = "runs/llama3-8B-causal-compile"
    for name in ("env.txt", "stages.tsv", "bench.jsonl", "parity.jsonl", "table.md", f"{run}.metrics.jsonl",
                 f"{run}.trace.json.gz"):  # fmt: skip
        assert f"\n{name}  " in manifest, name
    assert "left out  runs/tt-llama3-8B.trace.json.gz" in manifest
    with gzip.open(dest / "runs" / "llama3-8B-causal-compile.trace.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"] == TRACE
    table = (dest / "table.md").read_text()
    assert table.startswith("## GPU lease, 2026-11-29") and "2 of 3 entries passed" in table
    assert results.read_text().startswith("# Results\n\n## GPU lease, 2026-11-29")
    # The MFU figure beside the table, linked from both (matplotlib: plait-trainer's test extra).
    assert (dest / "mfu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![MFU per run](mfu.png)" in table
    assert "![MFU per run](leases/2026-11-29-0123456789ab/mfu.png)" in results.read_text()
    assert lease_archive.main(argv[:-2]) == 2  # the folder exists: --force


def test_the_suites_tokens_per_second_figure(tmp_path, monkeypatch):
    """benchmarks/suite.py's layouts as bars (benchmarks/layout_figure.py): plait's runs only, in the
    suite's order, a failed run left out; read back through matplotlib's own objects."""
    import layout_figure
    from matplotlib.figure import Figure

    medians = {"plait:llama3-1:eager": 1200.0, "torchtitan:llama3-1:eager": 1000.0, "plait:llama3-tp2:eager": 2100.0,
               "plait:llama3-seq4096-cp2-ring:compile": None}  # fmt: skip
    drawn, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    assert layout_figure.draw_tokens_per_second(medians, tmp_path / "figures" / "layouts.png", "t")
    (ax,) = drawn[0].axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["llama3-1, eager", "llama3-tp2, eager"]
    assert [bar.get_width() for bar in ax.patches] == [1200.0, 2100.0]
    assert (tmp_path / "figures" / "layouts.png").read_bytes()[:4] == b"\x89PNG"
    assert not layout_figure.draw_tokens_per_second({"plait:x:eager": None}, tmp_path / "none.png", "t")
