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
torchtitan does the same work as plait's causal compiled run (gpu_torchtitan.py, torchtitan_gpu.py):
same depth, batch, sequence, bf16 autocast over fp32 weights (0.2.2 on one GPU, as plait on one
rank), causal attention (0.2.2's DeepSeek-V3 mask made causal; 0.3.0 has only block-causal ones),
plait's selective-AC save list, model and loss compiled; its record says `equal_work`.

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
time, error, plait-train's arguments); `--logs` keeps each run's last lines, its metrics.jsonl
and its profiler trace, gzipped (the lease's raw outputs: benchmarks/leases/README.md).

Configs (the shipped flavors, depth reduced so that one GPU holds model, gradients and AdamW):
  llama3-1B     Llama 3.2 1B, all 16 layers, seq 8192, batch 1
  llama3-8B     Llama 3.1 8B dims, 8 of 32 layers, seq 8192, batch 1
  deepseek-16B  DeepSeek-V3 16B (DeepSeek-MoE 16B dims: 64 routed experts top-6, 2 shared), 1 dense
                + 3 MoE of 28 layers, seq 4096, batch 1
Figures per run (benchmarks/leases/README.md lists every field): tokens/s and step time, both
the sync-to-sync wall clock (plait's `step_time_s` at log_freq 1; torchtitan's tokens / tps) and,
for plait, the step's CUDA-event time (`device_step_s`); peak memory; `mfu`, each framework's own;
and, for both frameworks from plait's FLOPs per token of the same model (6 x non-embedding params
+ attention), TFLOP/s and MFU with causal attention counted whole (`mfu_attn_whole`, plait's and
torchtitan's convention) and halved (`mfu_attn_half`), over the GPU's dense bf16 peak (989
TFLOP/s for H100 / H200 SXM, plait's table; benchmarks/gemm_peak.py measures what a bf16 GEMM
of the model's shapes reaches on the leased chip). The anchor is
torchtitan's published 33-39 % MFU for Llama 3 8B on H100 (FSDP, compile, bf16); a reduced-depth
model on one GPU has relatively more embedding/output work, which the MFU formula does not count,
so it reads a little lower.

Attention is causal by default (torchtitan's default, so the two compare); `--attention-mask
document` takes the shipped configs' document masking. No hub download: text is plait's built-in
corpus, tokens from the shipped 2048-id BPE (the models keep their full vocabularies, so the output
layer costs what it costs in a real run). Each run is a `plait-train` subprocess; figures are
medians over the steps after the warmup (compile and autotuning). `--profile` profiles the last
step of each run, plait's and torchtitan's (its own profiler); profile_summary.step_profile reads
that step's host launch time and the GPU busy time of the work it launched, per step. torchtitan
runs when `import torchtitan` works, or from
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
import json
import os
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
from gpu_common import (  # noqa: E402
    CONFIGS,
    MASKS,
    SAMPLES,
    Stopped,
    batch_of,
    failure,
    keep_log,
    keep_outputs,
    layers_of,
    model_flops,
    on_sigterm,
    peak_tflops,
    run_bounded,
    step_times,
    throughput_figures,
)
from gpu_torchtitan import choose_torchtitan, run_torchtitan, torchtitan_available  # noqa: E402
from lease_table import bench_table  # noqa: E402  (the table the lease's section shows)
from profile_summary import step_profile  # noqa: E402

_run = run_bounded  # (its name in tests/test_combo_lease_dry_run.py)
TT_TOKENIZER = REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer"
TORCHTITAN_VERSIONS = ("0.3.0", "0.2.2")  # newest first: 0.3.0 needs torch >= 2.12
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
    # Issue 54, against "compile" (the unfused loss, fp32 moments) in the same lease: peak memory and
    # tokens/s with the chunked loss, and with bf16 optimizer states.
    "chunked": ["--training.compile", "true"],  # with --training.loss chunked (LOSS_OF_MODE)
    "bf16states": ["--training.compile", "true", "--optimizer.state_dtype", "bf16"],
}
# The shipped 128k-vocabulary configs train with the chunked loss; every other mode runs the unfused
# one, torchtitan's (equal work on both sides of a ratio).
LOSS_OF_MODE = {"chunked": "chunked"}


# ---- plait -----------------------------------------------------------------------------------


def plait_command(name: str, args, dump: Path, mode: str, mask: str) -> list[str]:
    config_file, layers_opt, seq, _, _ = CONFIGS[name]
    batch = batch_of(name, args)
    cmd = [sys.executable, "-m", "plait.trainer", "--config", config_file, "--job.dump_folder", str(dump),
           "--model.tokenizer_path", "", "--model.n_layers", str(getattr(args, layers_opt)),
           "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
           "--training.dtype", "bfloat16", "--training.loss", LOSS_OF_MODE.get(mode, "full"),
           *MODES[mode],
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
        rc, timed_out = run_bounded(cmd, env, log, timeout)
    keep_log(log, args)
    if rc != 0 or timed_out:
        return failure(rc, timed_out, timeout, log)
    return _plait_figures(name, args, dump, f"{name}-{mask}-{mode}", cmd)


def _plait_figures(name: str, args, dump: Path, run: str, cmd: list[str]) -> dict:
    """A finished plait run's figures: medians of the steps after the warmup (tokens/s, plait's
    MFU, wall and CUDA-event step times), the peak memory, the profiled step (per step: host launch
    and GPU busy time), its outputs kept, and its plait-train arguments (for plait-plan)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["step"] > args.warmup and "tokens_per_second" in r]
    if not kept:
        return {"error": f"no step after the {args.warmup} warmup steps in metrics.jsonl"}
    traces = sorted((dump / "profile").glob("step*_rank0.json")) if args.profile else []
    profile = step_profile(traces[-1]) if traces else None
    if profile:
        print(f"[gpu] {run} profiled step: {profile}", flush=True)
    train_args = cmd[cmd.index("plait.trainer") + 1 :]
    at = train_args.index("--job.dump_folder")
    return {
        "profile": profile,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in kept),
        "mfu": statistics.median(r["mfu"] for r in kept),
        "memory_gib": max(r["memory_gib"] for r in kept),
        **step_times(kept),
        "layers": layers_of(name, args),
        "plait_args": train_args[:at] + train_args[at + 2 :],
        **keep_outputs(args, run, dump / "metrics.jsonl", traces[-1] if traces else None),
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


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--profile", action="store_true", help="profile the last step: host launch time vs GPU busy time, per step"
    )
    parser.add_argument("--deadline", type=float, help="seconds for all the runs; later runs are not started")
    parser.add_argument("--min-run-s", type=float, default=40, help="start a run only with this many seconds left")
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds one run may take")
    parser.add_argument("--json", type=Path, help="append one JSON record per run")
    parser.add_argument(
        "--logs", type=Path, help="keep each run's last lines, metrics.jsonl and gzipped profiler trace here"
    )
    parser.add_argument("--torchtitan-path", type=Path, help="torchtitan 0.3.0's site folder, for its runs only")
    parser.add_argument("--torchtitan-022-path", type=Path, help="torchtitan 0.2.2's site folder, likewise")
    parser.add_argument("--torchtitan-version", choices=("auto", *TORCHTITAN_VERSIONS), default="auto",
                        help="auto: 0.3.0 where this torch has what it imports (torch >= 2.12), else 0.2.2")
    parser.add_argument("--tt-tokenizer", type=Path, default=TT_TOKENIZER, help="torchtitan's tokenizer folder")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the command lines, read benchmarks/lease_samples/ as their outputs")
    parser.add_argument("--no-results", action="store_true")
    return parser


def _flops(name: str, args, cache: dict) -> dict | None:
    """The config's FLOPs per token (both attention conventions), once per config; None if plait's
    config cannot say (the record then has no MFU columns)."""
    if name not in cache:
        try:
            cache[name] = model_flops(plait_command(name, args, Path("unused"), "compile", "causal"))
        except Exception as e:  # a figure missing is no reason to lose the run
            print(f"[gpu] {name}: FLOPs per token not known: {type(e).__name__}: {e}", flush=True)
            cache[name] = None
    return cache[name]


def _one_run(name: str, mask: str, mode: str, args, tmp: Path, left) -> dict:
    remaining = left()
    timeout = args.run_timeout if remaining is None else min(args.run_timeout, remaining)
    try:
        if remaining is not None and remaining < args.min_run_s:
            return {"error": f"not run: {max(remaining, 0):.0f} s of the deadline left", "skipped": True}
        if mode == "torchtitan":
            return {"torchtitan_version": args.tt_version,
                    **run_torchtitan(name, args, tmp, timeout=timeout, deadline=left)}  # fmt: skip
        return run_plait(name, args, tmp, mode, mask, timeout=timeout)
    except Stopped:
        return {"error": "stopped (SIGTERM: the lease's stage limit)"}


def _run_all(runs: list[tuple[str, str, str]], args, peak: float) -> list[dict]:
    """Every run in order, within the deadline; one record each (appended to --json as it ends)."""
    start, flops = time.monotonic(), {}

    def left() -> float | None:
        return None if args.deadline is None else args.deadline - (time.monotonic() - start)

    records = []
    with tempfile.TemporaryDirectory(prefix="plait-gpu-") as tmp:
        for name, mask, mode in runs:
            began = time.monotonic()
            result = _one_run(name, mask, mode, args, Path(tmp), left)
            if "error" not in result:
                result.update(throughput_figures(result, _flops(name, args, flops), peak))
            record = {"config": name, "mask": mask, "mode": mode, "framework": "torchtitan" if mode == "torchtitan"
                      else "plait", "seq": CONFIGS[name][2], "batch": batch_of(name, args), "steps": args.steps,
                      "warmup": args.warmup, "wall_s": round(time.monotonic() - began, 1), "dry_run": args.dry_run,
                      **result}  # fmt: skip
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
            records.append(record)
            print(bench_table([record])[-1], flush=True)
            if result.get("error", "").startswith("stopped (SIGTERM"):
                break
    return records


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
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
        gpu = "dry run (no GPU: sample outputs; MFU over an H100's 989 TFLOP/s)"
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (H100/H200); on CPU use benchmarks/suite.py (or --dry-run).")
    else:
        gpu = torch.cuda.get_device_name(0)
    signal.signal(signal.SIGTERM, on_sigterm)
    records = _run_all(runs, args, peak_tflops("H100" if args.dry_run else gpu))
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    header = (f"## GPU benchmark, {datetime.date.today()} (`benchmarks/gpu.py`)\n\n{gpu}; torch {torch.__version__}; "
              f"commit {commit.stdout.strip() or 'unknown'}; bf16, selective AC, 1 GPU; "
              f"{args.steps} steps, {args.warmup} warmup.\n")  # fmt: skip
    text = header + "\n" + "\n".join(bench_table(records)) + "\n"
    print("\n" + text)
    if not args.no_results and not args.dry_run:
        results = HERE / "RESULTS.md"
        title, _, rest = results.read_text().partition("\n")
        results.write_text(f"{title}\n\n{text}{rest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
