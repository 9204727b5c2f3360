"""Document attention: one call per layer against one SDPA call per document, forward and backward.

    python benchmarks/bench_varlen.py [--json OUT.jsonl]          on CUDA: Llama 3 8B dims, seq 8192, bf16
    python benchmarks/bench_varlen.py --device cpu --dry-run      tiny dims in seconds (gpu/lease.sh --dry-run)

Llama 3 8B's attention dims (32 query heads, 8 kv heads, head dim 128: GQA as the model calls it,
no copies), one packed row of `--seq` tokens cut into 1, 8 and 64 equal documents. Two ways to
compute the same block-diagonal causal attention:

  one call      `plait.models.document_attention.document_attention`: one `plait::document_attention`
                op over the folded tokens with the documents' offsets (int32 on the device, built on
                the host by `plait.models.documents.document_offsets` with the trainer's capacity,
                max_seqlen = the row length, as the loader passes them). On CUDA in bf16 one
                FlashAttention-2 varlen call forward and one backward.
  per segment   `segment_loop_attention`: one causal SDPA call per document (what the model did
                before the op), differentiable through SDPA's own backward.

Each is timed for the forward alone and for forward + backward (a fresh output gradient each
step, the input gradients cleared), `--warmup` untimed calls first, then the median of `--iters`:
device time by CUDA events around the call, host time by the clock from the call until its last
op is queued (before the synchronize; on the CPU the two are the same work). The first call of
each pair also checks that the two agree (max |difference| of the outputs and input gradients).
TFLOP/s counts the FLOPs of the real documents (causal per document: L (L + 1) / 2 query-key pairs,
4 x H x A FLOPs each forward, 2.5x that backward). One JSON line per (documents, method) goes to
`--json`; a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from plait.models.document_attention import document_attention, segment_loop_attention
from plait.models.documents import document_offsets, documents_capacity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lease_table import varlen_table  # noqa: E402  (the rows the lease's table shows)

LLAMA3_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128, "seq": 8192}
TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq": 256}  # --dry-run: the same code in seconds
METHODS = ("one call", "per segment")


def equal_bounds(seq: int, docs: int) -> tuple[int, ...]:
    """(0, ..., seq): `docs` documents as equal as integers allow."""
    return tuple(round(i * seq / docs) for i in range(docs + 1))


def causal_pairs(bounds) -> int:
    return sum((e - s) * (e - s + 1) // 2 for s, e in zip(bounds, bounds[1:]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, warmup: int, iters: int) -> tuple[float, float]:
    """(device ms, host ms): medians over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    device_ms, host_ms = [], []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            device_ms.append(host_ms[-1])
    return statistics.median(device_ms), statistics.median(host_ms)


def run_case(docs: int, dims: dict, device: torch.device, dtype: torch.dtype, warmup: int, iters: int) -> list[dict]:
    seq, H, G, A = dims["seq"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    gen = torch.Generator(device="cpu").manual_seed(docs)
    q_THA, k_TGA, v_TGA = (
        torch.randn(seq, heads, A, generator=gen).to(device, dtype).requires_grad_() for heads in (H, G, G)
    )
    bounds = equal_bounds(seq, docs)
    segments = (bounds,)  # one row
    cu_seqlens_N = document_offsets(segments, seq, documents_capacity(segments)).to(device)
    calls = {
        "one call": lambda: document_attention(q_THA, k_TGA, v_TGA, cu_seqlens_N, seq),
        "per segment": lambda: segment_loop_attention(q_THA, k_TGA, v_TGA, list(bounds)),
    }
    dout_THA = torch.randn(seq, H, A, generator=gen).to(device, dtype)

    def clear() -> None:
        for t in (q_THA, k_TGA, v_TGA):
            t.grad = None

    # The two must agree before their times mean anything.
    results = {}
    for method, call in calls.items():
        clear()
        out = call()
        out.backward(dout_THA)
        results[method] = [out.detach().float(), *(t.grad.float() for t in (q_THA, k_TGA, v_TGA))]
    max_diff = max((a - b).abs().max().item() for a, b in zip(*results.values()))

    fwd_flops = causal_pairs(bounds) * 4 * H * A
    rows = []
    for method, call in calls.items():

        def forward_backward(call=call) -> None:
            clear()
            call().backward(dout_THA)

        fwd_ms, fwd_host_ms = _timed(call, device, warmup, iters)
        step_ms, step_host_ms = _timed(forward_backward, device, warmup, iters)
        rows.append({
            "documents": docs, "method": method, "seq": seq, "heads": H, "kv_heads": G, "head_dim": A,
            "dtype": str(dtype).removeprefix("torch."), "device": device.type,
            "forward_ms": fwd_ms, "forward_host_ms": fwd_host_ms,
            "forward_backward_ms": step_ms, "forward_backward_host_ms": step_host_ms,
            "tflops": fwd_flops * 3.5 / (step_ms * 1e-3) / 1e12, "max_abs_diff": max_diff,
            "capacity": cu_seqlens_N.numel() - 1,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help=f"tiny dims {TINY}, 1 warmup, 2 timed calls")
    parser.add_argument("--docs", default="1,8,64", help="documents per row, comma-separated")
    parser.add_argument("--seq", type=int, help=f"row length (default {LLAMA3_8B['seq']}; dry run {TINY['seq']})")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--json", type=Path, help="append one JSON line per (documents, method)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_varlen: no CUDA device (use --device cpu --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    dims = dict(TINY if args.dry_run else LLAMA3_8B)
    if args.seq:
        dims["seq"] = args.seq
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    iters = args.iters if args.iters is not None else (2 if args.dry_run else 10)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench_varlen: {name}, torch {torch.__version__}, {args.dtype}, seq {dims['seq']}, heads {dims['heads']}, "
          f"kv heads {dims['kv_heads']}, head dim {dims['head_dim']}; {warmup} warmup, median of {iters}", flush=True)
    rows = []
    for docs in (int(d) for d in args.docs.split(",")):
        case = run_case(docs, dims, device, dtype, warmup, iters)
        rows += case
        for r in case:
            print(json.dumps(r), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print("\n" + "\n".join(varlen_table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
