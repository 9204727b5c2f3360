"""What the leased GPU reaches: bf16 GEMMs at the benchmarked models' largest shapes, timed by CUDA
events, and the GPU's own report (`nvidia-smi -q`) idle and under that load. MFU (over the
989 TFLOP/s dense bf16 datasheet peak) is read against these: a step's TFLOP/s cannot exceed what
its own GEMMs reach on this chip at its clocks and power limit.

    python benchmarks/gemm_peak.py [--json OUT/gemm.jsonl] [--smi OUT/nvidia-smi.txt] [--reps 10]
        [--batch-16b N] [--dry-run]

Shapes: plait's flavors (plait.models), tokens T = seq x batch of benchmarks/gpu.py's configs,
each product as nn.Linear computes it, x_TD @ W_FD.T (cuBLAS's TN layout), bf16 in and out:
  llama3-8B     T = 8192: FFN up (w1 / w3) [T x 4096] @ [4096 x 14336], FFN down [T x 14336] @
                [14336 x 4096], its weight gradient [14336 x T] @ [T x 4096], output head
                [T x 4096] @ [4096 x 128256]
  deepseek-16B  T = 4096 x batch: the dense FFN up [T x 2048] @ [2048 x 10944], its down, its
                weight gradient, the output head [T x 2048] @ [2048 x 102400]
One record per GEMM in --json: median and best TFLOP/s over --reps timed calls (after 3 untimed),
ms, and the fraction of the datasheet peak. --smi writes `nvidia-smi -q` taken before any work
(idle: product, power limits, max clocks), then `nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,
TEMPERATURE` taken 1 s into ~3 s of queued output-head GEMMs (clocks, power draw and clock-event
reasons under load); benchmarks/lease_machine.py reads it for the table.

--dry-run (gpu/lease.sh --dry-run, on a CPU): the same GEMMs at 1/64 of each dimension on the CPU
(host clock), and benchmarks/lease_samples/nvidia-smi*.txt (samples of the layout, not this
machine) as the report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEAK_BF16 = 989.0  # H100 / H200 SXM dense bf16 TFLOP/s (plait.trainer.metrics' table)


def shapes(batch_16b: int) -> list[tuple[str, str, int, int, int]]:
    """(config, GEMM, M, K, N): out[M, N] = a[M, K] @ b[N, K].T for each benchmarked model."""
    from plait.models.registry import get_model_args

    llama, ds = get_model_args("llama3", "8B"), get_model_args("deepseek_v3", "16B")
    t8, t16 = 8192, 4096 * batch_16b
    return [
        ("llama3-8B", "FFN up (w1, w3)", t8, llama.dim, llama.ffn_hidden_dim),
        ("llama3-8B", "FFN down (w2)", t8, llama.ffn_hidden_dim, llama.dim),
        ("llama3-8B", "FFN down weight grad", llama.ffn_hidden_dim, t8, llama.dim),
        ("llama3-8B", "output head", t8, llama.dim, llama.vocab_size),
        ("deepseek-16B", "dense FFN up", t16, ds.dim, ds.inter_dim),
        ("deepseek-16B", "dense FFN down", t16, ds.inter_dim, ds.dim),
        ("deepseek-16B", "dense FFN down weight grad", ds.inter_dim, t16, ds.dim),
        ("deepseek-16B", "output head", t16, ds.dim, ds.vocab_size),
    ]


def time_gemm(m: int, k: int, n: int, reps: int, device: str) -> list[float]:
    """Seconds per call of a[m, k] @ b[n, k].T in bf16, `reps` times after 3 untimed (CUDA events
    around each call on a GPU; the host clock on a CPU)."""
    import torch

    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b.t())
    seconds = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b.t())
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            torch.mm(a, b.t())
            seconds.append(time.perf_counter() - began)
    return seconds


def smi(args: list[str]) -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi: not found\n"
    proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    return proc.stdout + proc.stderr


def under_load(m: int, k: int, n: int, seconds_per_call: float) -> tuple[str, int]:
    """`nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,TEMPERATURE` 1 s into ~3 s of queued GEMMs (the
    host is free while they run); the calls queued."""
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    calls = max(1, int(3.0 / max(seconds_per_call, 1e-6)))
    for _ in range(calls):
        torch.mm(a, b.t())
    time.sleep(1.0)
    report = smi(["-q", "-d", "CLOCK,POWER,PERFORMANCE,TEMPERATURE"])
    torch.cuda.synchronize()
    return report, calls


def measure(args) -> tuple[list[dict], str]:
    """The GEMM records and the nvidia-smi text."""
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("benchmarks/gemm_peak.py needs a CUDA GPU (or --dry-run)")
    scale = 64 if args.dry_run else 1
    idle = (HERE / "lease_samples" / "nvidia-smi.txt").read_text() if args.dry_run else smi(["-q"])
    gpu = "dry run: CPU, dims / 64" if args.dry_run else torch.cuda.get_device_name(0)
    records = []
    for config, name, m, k, n in shapes(args.batch_16b):
        m, k, n = max(1, m // scale), max(1, k // scale), max(1, n // scale)
        seconds = time_gemm(m, k, n, args.reps, device)
        tflops = [2 * m * k * n / s / 1e12 for s in seconds]
        records.append({"config": config, "gemm": name, "m": m, "k": k, "n": n, "dtype": "bfloat16",
                        "reps": args.reps, "ms": statistics.median(seconds) * 1e3,
                        "tflops": statistics.median(tflops), "best_tflops": max(tflops),
                        "of_peak": statistics.median(tflops) / PEAK_BF16, "peak_tflops": PEAK_BF16,
                        "device": gpu, "dry_run": args.dry_run})  # fmt: skip
        print(f"[gemm] {config} {name} [{m} x {k}] @ [{k} x {n}]: {records[-1]['tflops']:.4g} TFLOP/s "
              f"(best {records[-1]['best_tflops']:.4g}), {records[-1]['ms']:.3f} ms", flush=True)  # fmt: skip
    head = next(r for r in records if r["config"] == "llama3-8B" and r["gemm"] == "output head")
    if args.dry_run:
        load, note = (HERE / "lease_samples" / "nvidia-smi-load.txt").read_text(), "dry run: a sample, not this machine"
    else:
        load, calls = under_load(head["m"], head["k"], head["n"], head["ms"] / 1e3)
        note = f"{calls} bf16 GEMMs [{head['m']} x {head['k']}] @ [{head['k']} x {head['n']}] queued, 1 s in"
    idle_note = f" ({note})" if args.dry_run else ""
    text = (f"# nvidia-smi -q, idle (before the GEMMs){idle_note}\n{idle}\n"
            f"# nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,TEMPERATURE, under load ({note})\n{load}")  # fmt: skip
    return records, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="append one record per GEMM")
    parser.add_argument("--smi", type=Path, help="write nvidia-smi -q, idle and under load, here")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batch-16b", type=int, default=1, help="DeepSeek's local batch (benchmarks/gpu.py's)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, dims / 64, the sample nvidia-smi report")
    args = parser.parse_args(argv)
    records, text = measure(args)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    if args.smi:
        args.smi.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
