"""bf16 products on this CPU: torch's bf16 kernels vs plait's fp32 route (plait.models.cpu_bf16).

Forward + backward of each product of the DeepSeek-V3 debug model's bf16 step (batch 4 x seq 256 =
1024 tokens; top-3 of 8 experts), once through torch's bf16 op and once through the fp32 kernels
that plait runs on a CPU without bf16 units, in this process, alternating, medians. Both branches
run on any CPU (the flag is set here), so on a CPU with bf16 units it shows why plait keeps
torch's kernels there. Prints the ratio per product and for the step's products weighted by how
often the model runs each.

    python benchmarks/bench_cpu_bf16.py [--threads 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from plait.models import cpu_bf16

T, E, K = 1024, 8, 3
ROWS = T * K // E  # rows per expert, even routing
# name, how many per step (layers: 1 dense + 5 MoE), kind, operand shapes
PRODUCTS = [
    ("attention wq 256 -> 3072", 6, "linear", [(T, 256), (3072, 256)]),
    ("attention wkv_a 256 -> 576", 6, "linear", [(T, 256), (576, 256)]),
    ("attention wkv_b 512 -> 4096", 6, "linear", [(T, 512), (4096, 512)]),
    ("attention wo 2048 -> 256", 6, "linear", [(T, 2048), (256, 2048)]),
    ("dense FFN w1 / w3 256 -> 1024", 2, "linear", [(T, 256), (1024, 256)]),
    ("dense FFN w2 1024 -> 256", 1, "linear", [(T, 1024), (256, 1024)]),
    ("shared experts w1 / w3 256 -> 512", 10, "linear", [(T, 256), (512, 256)]),
    ("shared experts w2 512 -> 256", 5, "linear", [(T, 512), (256, 512)]),
    ("router 256 -> 8", 5, "linear", [(T, 256), (8, 256)]),
    ("output head 256 -> 2048", 1, "linear", [(T, 256), (2048, 256)]),
    (f"routed experts grouped, 8 x {ROWS} rows, 256 -> 256", 15, "grouped_mm", [(E * ROWS, 256), (E, 256, 256)]),
    (f"routed experts batched (capacity mode, instead), 8 x {ROWS}", 15, "bmm", [(E, ROWS, 256), (E, 256, 256)]),
]


def _op(kind: str):
    if kind == "linear":
        return cpu_bf16.linear
    if kind == "bmm":
        return cpu_bf16.bmm
    from plait.models.moe.experts import _grouped_mm

    offs = torch.arange(1, E + 1, dtype=torch.int32) * ROWS
    return lambda a, b: _grouped_mm(a, b, offs)


def _time(fn, leaves, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        y = fn(*leaves)
        torch.autograd.grad(y, leaves, torch.ones_like(y))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = cpu_bf16.CPU_BF16_UNITS
    print(f"bf16 units on this CPU: {native}; {args.threads} thread(s); forward + backward, median ms")
    print("| product | per step | torch bf16 kernel | fp32 kernels, casts counted | ratio |")
    print("|---|---|---|---|---|")
    total = {True: 0.0, False: 0.0}
    g = torch.Generator().manual_seed(0)
    for name, count, kind, shapes in PRODUCTS:
        leaves = [torch.randn(*s, generator=g).bfloat16().requires_grad_() for s in shapes]
        fn = _op(kind)
        medians = {}
        runs: dict[bool, list[float]] = {True: [], False: []}
        for units in (True, False, True, False):  # warm both, then alternate
            cpu_bf16.CPU_BF16_UNITS = units
            runs[units] += _time(fn, leaves, args.repeats)
        for units in (True, False):
            medians[units] = statistics.median(runs[units][args.repeats :]) * 1e3
            if kind != "bmm":  # capacity mode's experts replace the grouped ones: one of the two per step
                total[units] += count * medians[units]
        print(f"| {name} | {count} | {medians[True]:.2f} | {medians[False]:.2f} | {medians[True] / medians[False]:.2f}x |")
    cpu_bf16.CPU_BF16_UNITS = native
    print(f"| the step's products (dropless; weighted by per step) | | {total[True]:.0f} | {total[False]:.0f} | {total[True] / total[False]:.2f}x |")


if __name__ == "__main__":
    main()
