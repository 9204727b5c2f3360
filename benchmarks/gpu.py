"""GPU benchmark for one H100/H200: tokens/s, MFU and peak memory of plait-train (and of
torchtitan 0.3.0 where it is installed), bf16, torch.compile, selective activation checkpointing.

    python benchmarks/gpu.py [--steps 30] [--warmup 10] [--only llama3-1B,llama3-8B,deepseek-16B]
        [--layers-8b 8] [--layers-1b 16] [--layers-16b 4] [--modes compile] [--attention-mask causal]
        [--profile] [--no-results]

`--modes eager,compile,cudagraphs` runs plait once per mode (cudagraphs: training.compile_mode =
reduce-overhead, each compiled block replayed as a CUDA graph; docs/cuda_graphs.md), torchtitan
once, compiled.

Configs (the shipped flavors, depth reduced so that one GPU holds model, gradients and AdamW):
  llama3-1B     Llama 3.2 1B, all 16 layers, seq 8192, batch 1
  llama3-8B     Llama 3.1 8B dims, 8 of 32 layers, seq 8192, batch 1
  deepseek-16B  DeepSeek-V3 16B (DeepSeek-MoE 16B dims: 64 routed experts top-6, 2 shared), 1 dense
                + 3 MoE of 28 layers, seq 4096, batch 1
MFU is plait-train's: 6 x non-embedding params x tokens + attention flops over the GPU's dense bf16
peak (989 TFLOP/s for H100 SXM, from plait's table). The anchor is torchtitan's published 33-39 %
MFU for Llama 3 8B on H100 (FSDP, compile, bf16); a reduced-depth model on one GPU has relatively
more embedding/output work, which the MFU formula does not count, so it reads a little lower.

Attention is causal by default (torchtitan's default, so the two compare); `--attention-mask
document` takes the shipped configs' document masking. No hub download: text is plait's built-in
corpus, tokens from the shipped 2048-id BPE (the models keep their full vocabularies, so the output
layer costs what it costs in a real run). Each run is a `plait-train` subprocess; figures are
medians over the steps after the warmup (compile and autotuning). torchtitan runs when `import
torchtitan` works (same dims and depth, through torchtitan_gpu.py, its own defaults otherwise);
where it does not install (no network on the GPU host) the table says so. With results on, a dated
section (GPU, commit, torch) is appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from common import ANSI, CORPUS_DIR, TT_STEP  # noqa: E402
from profile_summary import device_busy  # noqa: E402

CONFIGS = {
    # name -> (plait config file, layers option, seq_len, local batch, torchtitan module/flavor)
    "llama3-1B": ("llama3_1B.toml", "layers_1b", 8192, 1, ("llama3", "llama3_1b")),
    "llama3-8B": ("llama3_8B.toml", "layers_8b", 8192, 1, ("llama3", "llama3_8b")),
    "deepseek-16B": ("deepseek_v3_16B.toml", "layers_16b", 4096, 1, ("deepseek_v3", "deepseek_v3_16b")),
}


MODES = {
    "eager": ["--training.compile", "false"],
    "compile": ["--training.compile", "true"],
    "cudagraphs": ["--training.compile", "true", "--training.compile_mode", "reduce-overhead"],
}


def run_plait(name: str, args, workdir: Path, mode: str = "compile") -> dict:
    config_file, layers_opt, seq, batch, _ = CONFIGS[name]
    dump = workdir / f"{name}-{mode}"
    cmd = [sys.executable, "-m", "plait.trainer", "--config", config_file, "--job.dump_folder", str(dump),
           "--model.tokenizer_path", "", "--model.n_layers", str(getattr(args, layers_opt)),
           "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
           "--training.dtype", "bfloat16", *MODES[mode],
           "--training.activation_checkpoint", "selective", "--training.steps", str(args.steps),
           "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
           "--checkpoint.enable", "false", "--checkpoint.interval", "0",
           "--data.val_interval", "0", "--data.dataset", "builtin", "--data.streaming", "false",
           "--model.attention_mask", args.attention_mask,
           "--parallelism.ep", "1"]  # fmt: skip  (one GPU: no expert parallel; the configs' c4 needs the hub)
    if args.profile:  # the last step, with CUDA activity: host time vs GPU busy time
        cmd += ["--metrics.profile_interval", str(args.steps)]
    log = workdir / f"{name}-{mode}.log"
    print(f"[gpu] {name}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        print("\n".join(tail), flush=True)
        return {"error": f"exit {rc}: {tail[-1] if tail else ''}"[:200]}
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["step"] > args.warmup and "tokens_per_second" in r]
    traces = sorted((dump / "profile").glob("step*_rank0.json")) if args.profile else []
    busy = device_busy(traces[-1]) if traces else None
    if busy:
        print(f"[gpu] {name} {mode} profiled step: {busy}", flush=True)
    return {
        "busy": busy,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in kept),
        "mfu": statistics.median(r["mfu"] for r in kept),
        "memory_gib": max(r["memory_gib"] for r in kept),
        "layers": getattr(args, layers_opt),
    }


def run_torchtitan(name: str, args, workdir: Path) -> dict:
    if importlib.util.find_spec("torchtitan") is None:
        return {"error": "torchtitan not installed here"}
    _, layers_opt, seq, batch, (module, flavor) = CONFIGS[name]
    tokenizer = (REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer").resolve()
    dump = workdir / f"tt-{name}"
    # torchtitan_gpu.py: torchtitan's trainer plus the reduced depth and a 1B config (see there).
    # Text from the same local folder as plait (no hub); its default selective AC; model and loss
    # compiled as plait compiles its blocks; one GPU, so no expert parallel.
    cmd = [sys.executable, str(HERE / "torchtitan_gpu.py"), "--layers", str(getattr(args, layers_opt)),
           "--module", module, "--config", flavor, "--hf_assets_path", str(tokenizer),
           "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(CORPUS_DIR),
           "--dump_folder", str(dump), "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
           "--training.steps", str(args.steps), "--metrics.log_freq", "1",
           "--compile.enable", "--compile.components", "model,loss"]  # fmt: skip
    if module == "deepseek_v3":
        cmd += ["--parallelism.expert_parallel_degree", "1"]
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29591", PYTHONUNBUFFERED="1")  # fmt: skip
    log = workdir / f"tt-{name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    text = ANSI.sub("", log.read_text())
    if rc != 0:
        return {"error": f"exit {rc}: {text.splitlines()[-1] if text else ''}"[:200]}
    tps = [float(m.group(2).replace(",", "")) for m in TT_STEP.finditer(text) if int(m.group(1)) > args.warmup]
    mfu = [float(x) for x in re.findall(r"mfu:\s*([\d.]+)%", text)[args.warmup:]]
    mem = [float(x) for x in re.findall(r"memory:\s*([\d.]+)GiB", text)]
    return {
        "tokens_per_second": statistics.median(tps) if tps else float("nan"),
        "mfu": statistics.median(mfu) / 100 if mfu else float("nan"),
        "memory_gib": max(mem) if mem else float("nan"),
    }


def _row(name: str, side: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | {side} | - | - | - | {r['error']} |"
    note = r.get("layers", "")
    if r.get("busy"):  # the profiled step (profiler overhead included): GPU busy / host time
        b = r["busy"]
        note = (f"{note}; profiled step: host {b['host_step_ms']:.0f} ms, GPU busy {b['device_busy_ms']:.0f} "
                f"of {b['device_span_ms']:.0f} ms")
    return (f"| {name} | {side} | {r['tokens_per_second']:,.0f} | {r['mfu']:.1%} | {r['memory_gib']:.1f} | "
            f"{note} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--layers-1b", type=int, default=16)
    parser.add_argument("--layers-8b", type=int, default=8)
    parser.add_argument("--layers-16b", type=int, default=4)
    parser.add_argument("--modes", default="compile", help=f"comma-separated plait modes of {','.join(MODES)}")
    parser.add_argument("--attention-mask", choices=("causal", "document"), default="causal",
                        help="causal: torchtitan's default, comparable; document: the shipped configs' masking")
    parser.add_argument("--profile", action="store_true",
                        help="profile plait's last step: host time vs GPU busy time (host-bound or kernel-bound)")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (H100/H200); on CPU use benchmarks/suite.py.")
    gpu = torch.cuda.get_device_name(0)
    names = args.only.split(",") if args.only else list(CONFIGS)
    lines = ["| config | framework | tokens/s | MFU | peak GiB | layers / note |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="plait-gpu-") as tmp:
        for name in names:
            for mode in args.modes.split(","):
                lines.append(_row(name, f"plait {mode}", run_plait(name, args, Path(tmp), mode)))
                print(lines[-1], flush=True)
            lines.append(_row(name, "torchtitan 0.3.0", run_torchtitan(name, args, Path(tmp))))
            print(lines[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    header = (f"## GPU benchmark, {datetime.date.today()} (`benchmarks/gpu.py`)\n\n{gpu}; torch {torch.__version__}; "
              f"commit {commit.stdout.strip() or 'unknown'}; bf16, selective AC, {args.attention_mask} attention, 1 GPU; "
              f"{args.steps} steps, {args.warmup} warmup.\n")  # fmt: skip
    text = header + "\n" + "\n".join(lines) + "\n"
    print("\n" + text)
    if not args.no_results:
        results = HERE / "RESULTS.md"
        title, _, rest = results.read_text().partition("\n")
        results.write_text(f"{title}\n\n{text}{rest}")


if __name__ == "__main__":
    main()
