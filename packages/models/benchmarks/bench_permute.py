"""Time the permute-indices implementations against the Python reference (not a test).

    python packages/models/benchmarks/bench_permute.py             # CPU: reference vs torch
    TRITON_INTERPRET=1 python packages/models/benchmarks/bench_permute.py --triton   # + Triton
On a CUDA machine the Triton kernel runs compiled; the CPU interpreter timing only shows that
it runs, not how fast it is.
"""

import argparse
import time

import torch

from plait.models.moe.kernels import default_max_len, permute_indices_reference, permute_indices_torch


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (and Triton compilation)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--triton", action="store_true", help="also time the Triton kernel")
    parser.add_argument("--repeats", type=int, default=5)
    # One intra-op thread by default: on a small shared CPU box, thread oversubscription makes
    # the elementwise ops 30x slower and the timings meaningless.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = {"torch": permute_indices_torch}
    if args.triton:
        from plait.models.moe.triton_kernels import permute_indices_triton

        kernels["triton"] = permute_indices_triton
    print(f"device={device} threads={torch.get_num_threads()}")
    print(
        f"{'ep':>3} {'experts':>7} {'tokens':>8} {'align':>5} {'reference ms':>13}"
        + "".join(f" {k + ' ms':>10} {'x':>7}" for k in kernels)
    )
    g = torch.Generator().manual_seed(0)
    for ep, experts, tokens_per_rank, alignment in [
        (2, 4, 1024, 16),
        (8, 8, 4096, 16),
        (8, 32, 8192, 32),
        (64, 4, 4096, 32),
    ]:
        counts = torch.multinomial(torch.ones(ep * experts), tokens_per_rank * ep // 4, replacement=True, generator=g)
        counts = torch.bincount(counts, minlength=ep * experts).to(torch.int32) * 4
        max_len = default_max_len(int(counts.sum()), experts, alignment)
        call = (counts, ep, experts, max_len, alignment)
        reference = _time(lambda call=call: permute_indices_reference(*call), 1)
        row = f"{ep:>3} {experts:>7} {int(counts.sum()):>8} {alignment:>5} {reference * 1e3:>13.2f}"
        call_dev = (counts.to(device), *call[1:])
        for fn in kernels.values():
            t = _time(lambda fn=fn, call_dev=call_dev: fn(*call_dev), args.repeats)
            row += f" {t * 1e3:>10.3f} {reference / t:>6.0f}x"
        print(row)


if __name__ == "__main__":
    main()
