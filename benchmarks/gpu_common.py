"""What benchmarks/gpu.py and its torchtitan half (gpu_torchtitan.py) share: the configs, running
one command bounded by a timeout, keeping a run's outputs in the lease's folder, and the figures
derived from a run's tokens/s (FLOPs per token in both attention conventions, MFU, step times).
"""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import statistics
import subprocess
from pathlib import Path

from common import ANSI

HERE = Path(__file__).resolve().parent
SAMPLES = HERE / "lease_samples"

CONFIGS = {
    # name -> (plait config file, layers option, seq_len, local batch, torchtitan module/config)
    "llama3-1B": ("llama3_1B.toml", "layers_1b", 8192, 1, ("llama3", "llama3_1b")),
    "llama3-8B": ("llama3_8B.toml", "layers_8b", 8192, 1, ("llama3", "llama3_8b")),
    "deepseek-16B": ("deepseek_v3_16B.toml", "layers_16b", 4096, 1, ("deepseek_v3", "deepseek_v3_16b")),
}
MASKS = ("causal", "document")


def batch_of(name: str, args) -> int:
    return getattr(args, "batch_16b", 1) if name == "deepseek-16B" else CONFIGS[name][3]


def layers_of(name: str, args) -> int:
    return getattr(args, CONFIGS[name][1])


# ---- running one command, bounded ------------------------------------------------------------


class Stopped(Exception):
    """SIGTERM (gpu/lease.sh's `timeout`): stop the run in flight, then this script."""


def on_sigterm(signum, frame):
    raise Stopped()


def run_bounded(cmd: list[str], env: dict, log: Path, timeout: float | None) -> tuple[int, bool]:
    """(exit code, timed out): `cmd` in a session of its own, output to `log`; at `timeout` (or
    when this script is stopped) its whole process group gets SIGTERM, then SIGKILL 8 s later."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            return _stop(proc), True
        finally:
            if proc.poll() is None:  # stopped from outside (Stopped, KeyboardInterrupt)
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


def tail(log: Path, lines: int = 15) -> list[str]:
    return ANSI.sub("", log.read_text(errors="replace")).splitlines()[-lines:] if log.exists() else []


def keep_log(log: Path, args) -> None:
    if args.logs and log.exists():
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / log.name).write_text("\n".join(tail(log, 80)) + "\n")


def failure(rc: int, timed_out: bool, timeout: float | None, log: Path) -> dict:
    lines = tail(log)
    print("\n".join(lines), flush=True)
    if timed_out:
        return {"error": f"stopped at its {timeout:.0f} s limit"}
    last = next((line for line in reversed(lines) if line.strip()), "")
    return {"error": f"exit {rc}: {last}"[:200]}


def keep_outputs(args, run: str, metrics: Path | None, trace: Path | None) -> dict:
    """A run's metrics.jsonl and profiler trace (gzipped) beside its log in `--logs` (the lease's
    $OUT/runs): the raw outputs benchmarks/lease_archive.py commits. Their names there, relative
    to the lease's folder, for the run's record."""
    if not args.logs:
        return {}
    args.logs.mkdir(parents=True, exist_ok=True)
    kept = {}
    if metrics is not None and metrics.exists():
        shutil.copy(metrics, args.logs / f"{run}.metrics.jsonl")
        kept["metrics_file"] = f"{args.logs.name}/{run}.metrics.jsonl"
    if trace is not None and trace.exists():
        target = args.logs / f"{run}.trace.json.gz"
        if trace.suffix == ".gz":
            shutil.copy(trace, target)
        else:
            with open(trace, "rb") as src, gzip.open(target, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
        kept["trace_file"] = f"{args.logs.name}/{target.name}"
    return kept


# ---- figures from tokens/s -------------------------------------------------------------------


def peak_tflops(gpu: str) -> float:
    """The dense bf16 peak of the GPU named `gpu` by plait-train's table (H100 / H200: 989, what its
    MFU is over), NaN if not in it."""
    from plait.trainer.metrics import PEAK_TFLOPS_BF16

    return next((v for k, v in PEAK_TFLOPS_BF16.items() if k in gpu), float("nan"))


def step_times(rows: list[dict]) -> dict:
    """Medians over the measured steps of plait's metrics rows: the sync-to-sync wall time
    (`step_time_s`, one step per flush at log_freq 1) and, on CUDA, the step's CUDA-event time
    (`device_step_s`); and their ratio."""
    wall = statistics.median(r["step_time_s"] for r in rows) * 1e3 if rows else float("nan")
    out = {"step_ms_wall": wall}
    events = [r["device_step_s"] for r in rows if "device_step_s" in r]
    if events and len(events) == len(rows):
        out["step_ms_events"] = statistics.median(events) * 1e3
        out["events_vs_wall"] = out["step_ms_events"] / wall
    return out


def throughput_figures(record: dict, flops: dict | None, peak: float) -> dict:
    """From a run's tokens/s and its model's FLOPs per token (plait's formula, the same for
    torchtitan's run of the same dims): achieved TFLOP/s and MFU over `peak` with causal attention
    counted whole (the torchtitan convention, plait's `mfu`) and halved (the work a causal kernel
    does)."""
    tps = record.get("tokens_per_second")
    if not flops or tps is None or tps != tps:
        return {}
    whole, attention = flops["flops_per_token"], flops["attention_flops_per_token"]
    return {
        **flops,
        "peak_tflops": peak,
        "tflops": tps * whole / 1e12,
        "mfu_attn_whole": tps * whole / 1e12 / peak,
        "mfu_attn_half": tps * (whole - attention / 2) / 1e12 / peak,
    }


def model_flops(plait_cmd: list[str]) -> dict:
    """The model's training FLOPs per token at the command's sequence length, by plait-train's own
    config and the model's `flops_per_token` (the model built on the meta device); the attention
    term is what depends on the sequence: flops_per_token(seq) - flops_per_token(0)."""
    import torch

    from plait.trainer.cli import parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.model_args import model_spec, resolve_model_args

    parsed = parse_args(plait_cmd[plait_cmd.index("plait.trainer") + 1 :])
    config = build_config(load_toml(parsed.config), parsed.overrides)
    spec = model_spec(config)
    with torch.device("meta"):
        model = spec.model_cls(resolve_model_args(config, spec))
    seq = config.training.seq_len
    whole = model.flops_per_token(seq)
    return {"flops_per_token": whole, "attention_flops_per_token": whole - model.flops_per_token(0)}
