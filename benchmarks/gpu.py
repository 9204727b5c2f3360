"""GPU benchmark for one H100/H200: tokens/s, MFU and peak memory of plait-train (and of
torchtitan 0.3.0 or 0.2.2 where it is installed), bf16, torch.compile, selective activation checkpointing.

    python benchmarks/gpu.py [--steps 30] [--warmup 10] [--only llama3-1B,llama3-8B,deepseek-16B]
        [--layers-8b 8] [--layers-1b 16] [--layers-16b 4] [--modes compile] [--attention-mask causal]
        [--profile] [--no-results]
    python benchmarks/gpu.py --runs llama3-8B:causal:compile,llama3-8B:causal:torchtitan,... \\
        [--deadline S] [--run-timeout S] [--json OUT.jsonl] [--logs DIR] [--torchtitan-path DIR]
        [--torchtitan-022-path DIR] [--torchtitan-version auto|0.3.0|0.2.2] [--tt-tokenizer DIR] [--dry-run]

`--modes eager,compile,cudagraphs` runs plait once per mode (cudagraphs: training.compile_mode =
reduce-overhead, each compiled block replayed as a CUDA graph; docs/cuda_graphs.md; float8tw /
float8rw: compiled with training.float8 tensorwise / rowwise, MFU still over the bf16 peak; float8x:
float8rw with the MoE experts' grouped GEMMs in float8 too), torchtitan
once, compiled (and, torchtitan 0.3.0's default on CUDA, its forward-backward captured as one CUDA
graph; 0.2.2 has none). `--attention-mask causal,document` runs each mode with each mask.

Which torchtitan: the one that fits the running torch, decided once at start (`--torchtitan-version
auto`): 0.3.0 where `torch.distributed.fsdp` has `DataParallelMeshDims` (torch >= 2.12; 0.3.0
imports it), else 0.2.2, the last release without it (0.2.2's own CLI: TOML job configs, `--model.*`
flavors; benchmarks/torchtitan_gpu.py drives either). Each torchtitan record says which ran
(`torchtitan_version`), and the tables name it.

`--runs` lists the runs instead, in the order given, each `config:mask:mode` with mode one of
eager, compile, cudagraphs or torchtitan (causal only): what gpu/lease.sh passes, most wanted
first, since `--deadline` (seconds for this whole invocation) starts a run only while
`--min-run-s` are left, stops it at the deadline, and records the rest as not run. Every run is
also bounded by `--run-timeout`; a run stopped is signalled as a process group (plait-train's
compile workers go with it). `--json` appends one record per run (figures, profiled step, wall
time, error, command); `--logs` keeps each run's last lines.

Configs (the shipped flavors, depth reduced so that one GPU holds model, gradients and AdamW):
  llama3-1B     Llama 3.2 1B, all 16 layers, seq 8192, batch 1
  llama3-8B     Llama 3.1 8B dims, 8 of 32 layers, seq 8192, batch 1
  deepseek-16B  DeepSeek-V3 16B (DeepSeek-MoE 16B dims: 64 routed experts top-6, 2 shared), 1 dense
                + 3 MoE of 28 layers, seq 4096, batch 1
MFU is each framework's own: plait-train's is 6 x non-embedding params x tokens + attention flops
over the GPU's dense bf16 peak (989 TFLOP/s for H100 SXM, from plait's table). The anchor is
torchtitan's published 33-39 % MFU for Llama 3 8B on H100 (FSDP, compile, bf16); a reduced-depth
model on one GPU has relatively more embedding/output work, which the MFU formula does not count,
so it reads a little lower.

Attention is causal by default (torchtitan's default, so the two compare); `--attention-mask
document` takes the shipped configs' document masking. No hub download: text is plait's built-in
corpus, tokens from the shipped 2048-id BPE (the models keep their full vocabularies, so the output
layer costs what it costs in a real run). Each run is a `plait-train` subprocess; figures are
medians over the steps after the warmup (compile and autotuning). `--profile` profiles the last
step of each run, plait's and torchtitan's (its own profiler): host time of that step next to the
time the GPU was busy in it. torchtitan runs when `import torchtitan` works, or from
`--torchtitan-path` (0.3.0) / `--torchtitan-022-path` (0.2.2): a folder put first on its runs'
PYTHONPATH only (gpu/lease.sh installs each version's wheels into one, with the older `datasets`
0.3.0 pins); the table says where it did not.
With results on, a dated section (GPU, commit, torch) is prepended to benchmarks/RESULTS.md.

`--dry-run` (gpu/lease.sh --dry-run, on a CPU) builds every command line and checks it: plait's
with plait-train's own parser and validation, torchtitan's with torchtitan's own parser (when the
chosen version's folder holds it); then, instead of running them, reads the recorded sample outputs
in benchmarks/lease_samples/ (a metrics.jsonl, torchtitan log lines, two Chrome traces with kernel
events) through the same parsers as a real run. Its figures are those samples, not measurements.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from common import ANSI, CORPUS_DIR, TT_STEP  # noqa: E402
from profile_summary import device_busy  # noqa: E402

SAMPLES = HERE / "lease_samples"
TT_TOKENIZER = REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer"
TORCHTITAN_VERSIONS = ("0.3.0", "0.2.2")  # newest first: 0.3.0 needs torch >= 2.12

CONFIGS = {
    # name -> (plait config file, layers option, seq_len, local batch, torchtitan module/config)
    "llama3-1B": ("llama3_1B.toml", "layers_1b", 8192, 1, ("llama3", "llama3_1b")),
    "llama3-8B": ("llama3_8B.toml", "layers_8b", 8192, 1, ("llama3", "llama3_8b")),
    "deepseek-16B": ("deepseek_v3_16B.toml", "layers_16b", 4096, 1, ("deepseek_v3", "deepseek_v3_16b")),
}
MASKS = ("causal", "document")
MODES = {
    "eager": ["--training.compile", "false"],
    "compile": ["--training.compile", "true"],
    "cudagraphs": ["--training.compile", "true", "--training.compile_mode", "reduce-overhead"],
    # training.float8 (issue 42), compiled, torchao's filter: against "compile" (bf16) in the same lease.
    # One GPU has no FSDP, so tensorwise's float8 all-gather needs a 2-GPU lease.
    "float8tw": ["--training.compile", "true", "--training.float8", "tensorwise"],
    "float8rw": ["--training.compile", "true", "--training.float8", "rowwise"],
    # training.float8_experts (auto: rowwise on sm89 / sm90, MXFP8 on sm100) on top of float8rw.
    "float8x": ["--training.compile", "true", "--training.float8", "rowwise", "--training.float8_experts", "auto"],
}


# ---- running one command, bounded ------------------------------------------------------------


class _Stopped(Exception):
    """SIGTERM (gpu/lease.sh's `timeout`): stop the run in flight, then this script."""


def _on_sigterm(signum, frame):
    raise _Stopped()


def _run(cmd: list[str], env: dict, log: Path, timeout: float | None) -> tuple[int, bool]:
    """(exit code, timed out): `cmd` in a session of its own, output to `log`; at `timeout` (or
    when this script is stopped) its whole process group gets SIGTERM, then SIGKILL 8 s later."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            return _stop(proc), True
        finally:
            if proc.poll() is None:  # stopped from outside (_Stopped, KeyboardInterrupt)
                _stop(proc)


def _stop(proc: subprocess.Popen) -> int:
    for sig, grace in ((signal.SIGTERM, 8), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _tail(log: Path, lines: int = 15) -> list[str]:
    return ANSI.sub("", log.read_text(errors="replace")).splitlines()[-lines:] if log.exists() else []


def _keep_log(log: Path, args) -> None:
    if args.logs and log.exists():
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / log.name).write_text("\n".join(_tail(log, 80)) + "\n")


def _failure(rc: int, timed_out: bool, timeout: float | None, log: Path) -> dict:
    tail = _tail(log)
    print("\n".join(tail), flush=True)
    if timed_out:
        return {"error": f"stopped at its {timeout:.0f} s limit"}
    last = next((line for line in reversed(tail) if line.strip()), "")
    return {"error": f"exit {rc}: {last}"[:200]}


# ---- plait -----------------------------------------------------------------------------------


def _batch(name: str, args) -> int:
    return getattr(args, "batch_16b", 1) if name == "deepseek-16B" else CONFIGS[name][3]


def plait_command(name: str, args, dump: Path, mode: str, mask: str) -> list[str]:
    config_file, layers_opt, seq, batch, _ = CONFIGS[name]
    batch = _batch(name, args)
    cmd = [sys.executable, "-m", "plait.trainer", "--config", config_file, "--job.dump_folder", str(dump),
           "--model.tokenizer_path", "", "--model.n_layers", str(getattr(args, layers_opt)),
           "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
           "--training.dtype", "bfloat16", *MODES[mode],
           "--training.activation_checkpoint", "selective", "--training.steps", str(args.steps),
           "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
           "--checkpoint.enable", "false", "--checkpoint.interval", "0",
           "--data.val_interval", "0", "--data.dataset", "builtin", "--data.streaming", "false",
           "--model.attention_mask", mask,
           "--parallelism.ep", "1"]  # fmt: skip  (one GPU: no expert parallel; the configs' c4 needs the hub)
    if args.profile:  # the last step, with CUDA activity: host time vs GPU busy time
        cmd += ["--metrics.profile_interval", str(args.steps)]
    return cmd


def check_plait_command(cmd: list[str]) -> None:
    """Parse and validate a plait-train command line as plait-train would (ConfigError if not)."""
    from plait.trainer.cli import parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.validate import validate

    parsed = parse_args(cmd[cmd.index("plait.trainer") + 1 :])
    validate(build_config(load_toml(parsed.config), parsed.overrides), world_size=1)


def _fake_plait_outputs(dump: Path, args) -> None:
    """--dry-run: the recorded sample outputs where plait-train would write its own."""
    rows = [json.loads(line) for line in (SAMPLES / "plait_metrics.jsonl").read_text().splitlines()]
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= args.steps))
    if args.profile:
        (dump / "profile").mkdir(exist_ok=True)
        shutil.copy(SAMPLES / "plait_trace.json", dump / "profile" / f"step{args.steps}_rank0.json")


def run_plait(name: str, args, workdir: Path, mode: str = "compile", mask: str | None = None,
              timeout: float | None = None) -> dict:  # fmt: skip
    mask = mask or args.attention_mask.split(",")[0]
    dump = workdir / f"{name}-{mask}-{mode}"
    cmd = plait_command(name, args, dump, mode, mask)
    log = workdir / f"{name}-{mask}-{mode}.log"
    print(f"[gpu] {name}: {' '.join(cmd)}", flush=True)
    if args.dry_run:
        try:
            check_plait_command(cmd)
        except Exception as e:  # the run would fail the same way
            return {"error": f"dry run: {type(e).__name__}: {e}"[:200]}
        log.write_text(f"dry run: {' '.join(cmd)}\n")
        _fake_plait_outputs(dump, args)
        rc, timed_out = 0, False
    else:
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        rc, timed_out = _run(cmd, env, log, timeout)
    _keep_log(log, args)
    if rc != 0 or timed_out:
        return _failure(rc, timed_out, timeout, log)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["step"] > args.warmup and "tokens_per_second" in r]
    if not kept:
        return {"error": f"no step after the {args.warmup} warmup steps in metrics.jsonl"}
    traces = sorted((dump / "profile").glob("step*_rank0.json")) if args.profile else []
    busy = device_busy(traces[-1]) if traces else None
    if busy:
        print(f"[gpu] {name} {mask} {mode} profiled step: {busy}", flush=True)
    return {
        "busy": busy,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in kept),
        "mfu": statistics.median(r["mfu"] for r in kept),
        "memory_gib": max(r["memory_gib"] for r in kept),
        "layers": getattr(args, CONFIGS[name][1]),
    }


# ---- torchtitan ------------------------------------------------------------------------------


def choose_torchtitan(args) -> tuple[str, Path | None]:
    """(the torchtitan version its runs take, its site folder or None for this python's own),
    decided once: `--torchtitan-version`, or by default the one this torch runs: 0.3.0 imports
    `torch.distributed.fsdp.DataParallelMeshDims` (new in torch 2.12), 0.2.2 does not. Without
    either folder, the torchtitan this python imports (its version from its dist-info)."""
    version = args.torchtitan_version
    if version == "auto":
        import torch.distributed.fsdp as fsdp

        version = "0.3.0" if hasattr(fsdp, "DataParallelMeshDims") else "0.2.2"
    path = {"0.3.0": args.torchtitan_path, "0.2.2": args.torchtitan_022_path}[version]
    if path is None and args.torchtitan_path is None and args.torchtitan_022_path is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("torchtitan") if args.torchtitan_version == "auto" else version
        except PackageNotFoundError:
            pass
    return version, path


def _legacy(args) -> bool:
    """torchtitan 0.2.x: its CLI (TOML job config, --model.flavor, --job.*, --profiling.*)."""
    return args.tt_version.startswith(("0.1.", "0.2."))


def torchtitan_available(args) -> bool:
    if args.tt_path:
        return (Path(args.tt_path) / "torchtitan").is_dir()
    if args.torchtitan_path or args.torchtitan_022_path:  # only the other version's folder given
        return False
    return importlib.util.find_spec("torchtitan") is not None


def torchtitan_command(name: str, args, dump: Path, cuda_graphs: bool = True) -> list[str]:
    _, layers_opt, seq, batch, (module, config) = CONFIGS[name]
    batch = _batch(name, args)
    # torchtitan_gpu.py: torchtitan's trainer plus the reduced depth and a 1B config (see there).
    # Text from the same local folder as plait (no hub); its default selective AC; model and loss
    # compiled as plait compiles its blocks; one GPU, so no expert parallel.
    cmd = [sys.executable, str(HERE / "torchtitan_gpu.py"), "--layers", str(getattr(args, layers_opt))]
    common = ["--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
              "--training.steps", str(args.steps), "--metrics.log_freq", "1",
              "--compile.enable", "--compile.components", "model,loss"]  # fmt: skip
    if module == "deepseek_v3":
        common += ["--parallelism.expert_parallel_degree", "1"]
    if _legacy(args):  # 0.2.2: its job config by name (torchtitan_gpu.py holds them), its own sections
        cmd += ["--config", config, "--model.hf_assets_path", str(args.tt_tokenizer),
                "--training.dataset", "c4_test", "--training.dataset_path", str(CORPUS_DIR),
                "--job.dump_folder", str(dump), *common]  # fmt: skip
        if args.profile:  # its own profiler, the last step, traces where 0.3.0 writes them
            cmd += ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps),
                    "--profiling.profiler_warmup", str(min(3, args.steps - 1)),
                    "--profiling.save_traces_folder", "profiling/traces"]  # fmt: skip
        return cmd
    cmd += ["--module", module, "--config", config, "--hf_assets_path", str(args.tt_tokenizer),
            "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(CORPUS_DIR),
            "--dump_folder", str(dump), *common]  # fmt: skip
    if not cuda_graphs:
        cmd += ["--training.disable_cuda_graphs"]
    if args.profile:  # its own profiler, the last step: wait, warmup (<= 3), one active step
        cmd += ["--profiler.enable_profiling", "--profiler.profile_freq", str(args.steps),
                "--profiler.profiler_warmup", str(min(3, args.steps - 1))]  # fmt: skip
    return cmd


def _torchtitan_env(args) -> dict:
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29591", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # fmt: skip
    if args.tt_path:  # first, for these runs only: its `datasets` never meets plait's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.tt_path), env.get("PYTHONPATH")]))
    return env


def _fake_torchtitan_outputs(dump: Path, log: Path, args, parsed: str | None) -> None:
    """--dry-run: the recorded sample log (its first line, what the parse configured, replaced by
    the real parse's where there was one) and the sample trace, written as that torchtitan writes
    it (0.3.0 gzipped, 0.2.2 plain)."""
    sample = (SAMPLES / "torchtitan.log").read_text().replace("DUMP", str(dump)).splitlines()
    if parsed:
        sample[0] = parsed
    log.write_text("\n".join(sample) + "\n")
    if args.profile:
        folder = dump / "profiling" / "traces" / f"iteration_{args.steps}"
        folder.mkdir(parents=True, exist_ok=True)
        if _legacy(args):
            shutil.copy(SAMPLES / "torchtitan_trace.json", folder / "rank0_trace.json")
        else:
            with gzip.open(folder / "rank0_trace.json.gz", "wt") as f:  # 0.3.0 writes them gzipped
                f.write((SAMPLES / "torchtitan_trace.json").read_text())


def _check_torchtitan_command(cmd: list[str], args, log: Path) -> tuple[dict | None, str | None]:
    """--dry-run: torchtitan's own parser on the command line (torchtitan_gpu.py --check-args):
    (the failure or None, the line saying what it configured)."""
    check = [cmd[0], cmd[1], "--check-args", *cmd[2:]]
    rc, timed_out = _run(check, dict(_torchtitan_env(args), CUDA_VISIBLE_DEVICES=""), log, 120)
    print("\n".join(_tail(log, 3)), flush=True)
    if rc != 0 or timed_out:
        return _failure(rc, timed_out, 120, log), None
    return None, next((ln for ln in _tail(log, 50) if ln.startswith("torchtitan_gpu.py: ")), None)


def run_torchtitan(name: str, args, workdir: Path, timeout: float | None = None, deadline=None) -> dict:
    available = torchtitan_available(args)
    if not available and not args.dry_run:
        flag = "--torchtitan-022-path" if _legacy(args) else "--torchtitan-path"
        other = args.torchtitan_path or args.torchtitan_022_path  # only the other version's folder given
        where = f"in {args.tt_path}" if args.tt_path else f"(no {flag})" if other else "here"
        return {"error": f"torchtitan {args.tt_version} not installed {where}"}
    dump = workdir / f"tt-{name}"
    log = workdir / f"tt-{name}.log"
    cmd = torchtitan_command(name, args, dump)
    print(f"[gpu] {name} torchtitan: {' '.join(cmd)}", flush=True)
    note = ""
    if args.dry_run:
        failed, parsed = _check_torchtitan_command(cmd, args, log) if available else (None, None)
        if failed:
            return {"error": f"dry run: {failed['error']}"}
        if not available:
            note = "dry run: torchtitan not importable here, its command line not parsed"
            print(f"[gpu] {note}", flush=True)
        _fake_torchtitan_outputs(dump, log, args, parsed)
        rc, timed_out = 0, False
    else:
        rc, timed_out = _run(cmd, _torchtitan_env(args), log, timeout)
        left = deadline() if deadline else None
        capture = r"is capturing|StreamCapture|graph capture|capture_(begin|end)"
        graph_failed = (rc != 0 and not timed_out and not _legacy(args)
                        and re.search(capture, log.read_text(errors="replace"), re.I))  # fmt: skip
        if graph_failed and (left is None or left >= args.min_run_s):
            # Its default whole-step CUDA graph did not capture: once more without it.
            _keep_log(log, args)
            shutil.rmtree(dump, ignore_errors=True)
            cmd = torchtitan_command(name, args, dump, cuda_graphs=False)
            print(f"[gpu] {name} torchtitan again without its CUDA graph: {' '.join(cmd)}", flush=True)
            note = "its CUDA graph failed: --training.disable_cuda_graphs"
            log = workdir / f"tt-{name}-no-cudagraph.log"
            rc, timed_out = _run(cmd, _torchtitan_env(args), log, min(timeout or 1e9, left or 1e9))
    _keep_log(log, args)
    if rc != 0 or timed_out:
        return {**_failure(rc, timed_out, timeout, log), "note": note}
    text = ANSI.sub("", log.read_text())
    tps = [float(m.group(2).replace(",", "")) for m in TT_STEP.finditer(text) if int(m.group(1)) > args.warmup]
    mfu = [float(x) for x in re.findall(r"mfu:\s*([\d.]+)%", text)[args.warmup :]]
    mem = [float(x) for x in re.findall(r"memory:\s*([\d.]+)GiB", text)]
    traces = sorted(dump.glob("profiling/traces/iteration_*/rank0_trace.json*"),
                    key=lambda p: int(p.parent.name.split("_")[-1])) if args.profile else []  # fmt: skip
    busy = device_busy(traces[-1]) if traces else None
    graphs = re.search(r"torchtitan_gpu\.py: .*CUDA graphs (True|False)", text)
    attention = re.search(r"torchtitan_gpu\.py: .*, attention (.+)", text)
    mode = "compile + whole-step CUDA graph" if graphs and graphs.group(1) == "True" else "compile"
    return {
        "busy": busy,
        "tt_mode": f"{mode}; attention {attention.group(1).strip()}" if attention else mode,
        "tokens_per_second": statistics.median(tps) if tps else float("nan"),
        "mfu": statistics.median(mfu) / 100 if mfu else float("nan"),
        "memory_gib": max(mem) if mem else float("nan"),
        "layers": getattr(args, CONFIGS[name][1]),
        "note": note,
    }


# ---- the runs, the table ---------------------------------------------------------------------


def parse_runs(args) -> list[tuple[str, str, str]]:
    """(config, mask, mode) in the order to run them; mode "torchtitan" is torchtitan's run."""
    if args.runs:
        runs = [tuple(spec.split(":")) for spec in args.runs.split(",") if spec]
    else:
        names = args.only.split(",") if args.only else list(CONFIGS)
        masks, modes = args.attention_mask.split(","), args.modes.split(",")
        runs = []
        for name in names:
            runs += [(name, mask, mode) for mask in masks for mode in modes]
            if not args.no_torchtitan:
                runs.append((name, "causal", "torchtitan"))
    for run in runs:
        if len(run) != 3 or run[0] not in CONFIGS or run[1] not in MASKS or run[2] not in (*MODES, "torchtitan"):
            raise SystemExit(f"run {':'.join(run)!r}: expected CONFIG:MASK:MODE with CONFIG in {','.join(CONFIGS)}, "
                             f"MASK in {','.join(MASKS)}, MODE in {','.join(MODES)},torchtitan")  # fmt: skip
        if run[2] == "torchtitan" and run[1] != "causal":
            raise SystemExit(f"run {':'.join(run)!r}: torchtitan runs causal attention only here")
    return runs


def _row(name: str, side: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | {side} | - | - | - | {r['error']} |"
    note = str(r.get("layers", ""))
    if r.get("busy"):  # the profiled step (profiler overhead included): GPU busy / host time
        b = r["busy"]
        note = (f"{note}; profiled step: host {b['host_step_ms']:.0f} ms, GPU busy {b['device_busy_ms']:.0f} "
                f"of {b['device_span_ms']:.0f} ms")
    if r.get("note"):
        note = f"{note}; {r['note']}"
    return (f"| {name} | {side} | {r['tokens_per_second']:,.0f} | {r['mfu']:.1%} | {r['memory_gib']:.1f} | "
            f"{note} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--layers-1b", type=int, default=16)
    parser.add_argument("--layers-8b", type=int, default=8)
    parser.add_argument("--layers-16b", type=int, default=4)
    parser.add_argument("--batch-16b", type=int, default=1,
                        help="DeepSeek's local batch: at 1 x 4096 tokens its optimizer step outweighs the model")
    parser.add_argument("--modes", default="compile", help=f"comma-separated plait modes of {','.join(MODES)}")
    parser.add_argument("--attention-mask", default="causal",
                        help="causal (torchtitan's default, comparable), document (the shipped configs' masking), "
                             "or both, comma-separated")  # fmt: skip
    parser.add_argument("--runs", help="CONFIG:MASK:MODE,... in this order (MODE torchtitan: its run), instead of "
                                       "--only / --modes / --attention-mask")  # fmt: skip
    parser.add_argument("--no-torchtitan", action="store_true", help="without --runs: plait only")
    parser.add_argument("--profile", action="store_true",
                        help="profile the last step: host time vs GPU busy time (host-bound or kernel-bound)")
    parser.add_argument("--deadline", type=float, help="seconds for all the runs; later runs are not started")
    parser.add_argument("--min-run-s", type=float, default=40, help="start a run only with this many seconds left")
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds one run may take")
    parser.add_argument("--json", type=Path, help="append one JSON record per run")
    parser.add_argument("--logs", type=Path, help="keep each run's last lines here")
    parser.add_argument("--torchtitan-path", type=Path, help="torchtitan 0.3.0's site folder, for its runs only")
    parser.add_argument("--torchtitan-022-path", type=Path, help="torchtitan 0.2.2's site folder, likewise")
    parser.add_argument("--torchtitan-version", choices=("auto", *TORCHTITAN_VERSIONS), default="auto",
                        help="auto: 0.3.0 where this torch has what it imports (torch >= 2.12), else 0.2.2")
    parser.add_argument("--tt-tokenizer", type=Path, default=TT_TOKENIZER, help="torchtitan's tokenizer folder")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the command lines, read benchmarks/lease_samples/ as their outputs")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    for mask in args.attention_mask.split(","):
        if mask not in MASKS:
            parser.error(f"--attention-mask {mask!r}: one of {','.join(MASKS)}")
    runs = parse_runs(args)
    import torch

    if any(mode == "torchtitan" for _, _, mode in runs):
        args.tt_version, args.tt_path = choose_torchtitan(args)
        print(f"[gpu] torchtitan {args.tt_version} for torch {torch.__version__}: "
              f"{args.tt_path or ('this python' if torchtitan_available(args) else 'not installed')}",
              flush=True)  # fmt: skip

    if args.dry_run:
        gpu = "dry run (no GPU: sample outputs)"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (H100/H200); on CPU use benchmarks/suite.py (or --dry-run).")
    else:
        gpu = torch.cuda.get_device_name(0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    start = time.monotonic()

    def left() -> float | None:
        return None if args.deadline is None else args.deadline - (time.monotonic() - start)

    lines = ["| config | framework | tokens/s | MFU | peak GiB | layers / note |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="plait-gpu-") as tmp:
        for name, mask, mode in runs:
            remaining = left()
            began = time.monotonic()
            timeout = args.run_timeout if remaining is None else min(args.run_timeout, remaining)
            try:
                if remaining is not None and remaining < args.min_run_s:
                    result = {"error": f"not run: {max(remaining, 0):.0f} s of the deadline left", "skipped": True}
                elif mode == "torchtitan":
                    result = run_torchtitan(name, args, Path(tmp), timeout=timeout, deadline=left)
                else:
                    result = run_plait(name, args, Path(tmp), mode, mask, timeout=timeout)
            except _Stopped:
                result = {"error": "stopped (SIGTERM: the lease's stage limit)"}
            side = f"torchtitan {args.tt_version}" if mode == "torchtitan" else f"plait {mode}"
            if mode == "torchtitan":
                result = {"torchtitan_version": args.tt_version, **result}
            record = {"config": name, "mask": mask, "mode": mode, "framework": side.split()[0],
                      "seq": CONFIGS[name][2], "batch": _batch(name, args), "steps": args.steps, "warmup": args.warmup,
                      "wall_s": round(time.monotonic() - began, 1), "dry_run": args.dry_run, **result}  # fmt: skip
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
            lines.append(_row(f"{name} ({mask})", side, result))
            print(lines[-1], flush=True)
            if result.get("error", "").startswith("stopped (SIGTERM"):
                break
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    header = (f"## GPU benchmark, {datetime.date.today()} (`benchmarks/gpu.py`)\n\n{gpu}; torch {torch.__version__}; "
              f"commit {commit.stdout.strip() or 'unknown'}; bf16, selective AC, 1 GPU; "
              f"{args.steps} steps, {args.warmup} warmup.\n")  # fmt: skip
    text = header + "\n" + "\n".join(lines) + "\n"
    print("\n" + text)
    if not args.no_results and not args.dry_run:
        results = HERE / "RESULTS.md"
        title, _, rest = results.read_text().partition("\n")
        results.write_text(f"{title}\n\n{text}{rest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
