"""Document masking on this machine: tokens/s causal vs document, attention FLOPs skipped, CP balance.

    python benchmarks/bench_document_mask.py                    # seq 4096 and 16384, cp 1 and 2
    python benchmarks/bench_document_mask.py --seqs 4096 --steps 3

Rows are packed from a realistic document-length mix (log-normal, median 600 tokens, sigma 1.3:
web text's heavy tail, a few documents longer than a row; the rows start mid-document as the packed
loader's do). For each sequence length: Llama 3 debug (2 layers, fp32) training steps (forward,
backward, AdamW) with attention_mask causal and document, on 1 process with every core and on CP 2
(all-gather and ring, one thread per rank), medians of the timed steps, ratios against causal in
the same invocation. Attention work (query-key pairs computed, FLOPs-proportional) counted from
the plans the kernels run: the fraction document masking skips, and the per-rank max / mean
imbalance of our head-tail layout next to contiguous chunks and torchtitan's per-document
head-tail, at cp 2, 4, 8 (`plait.contextparallel.attention_work`).
"""

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from plait.contextparallel import ContextParallelConfig, SequenceLayout, apply_context_parallel, shard_sequence
from plait.contextparallel.work import PerDocumentHeadTail, attention_work, imbalance
from plait.mesh import ParallelDims, build_meshes
from plait.models.llama3 import FLAVORS, Transformer
from plait.testing import run_on_ranks

MEDIAN, SIGMA = 600, 1.3


def packed_rows(seq_len: int, rows: int, seed: int = 0) -> list[list[int]]:
    """Segment lengths of `rows` packed rows: one stream of log-normal documents cut every seq_len."""
    rng = np.random.default_rng(seed)
    lengths = []
    need = seq_len * rows + rng.integers(0, seq_len)  # a random phase: the first row starts mid-document
    while sum(lengths) < need:
        lengths.append(max(1, int(rng.lognormal(np.log(MEDIAN), SIGMA))))
    stream_ends = np.cumsum(lengths)
    start = int(need - seq_len * rows)
    out = []
    for r in range(rows):
        lo, hi = start + r * seq_len, start + (r + 1) * seq_len
        cuts = [lo] + [int(e) for e in stream_ends if lo < e < hi] + [hi]
        out.append([b - a for a, b in zip(cuts, cuts[1:])])
    return out


def document_positions(segments: list[int], first_offset: int = 7) -> torch.Tensor:
    pieces = [torch.arange(n) for n in segments]
    pieces[0] = pieces[0] + first_offset  # the row's first segment continues a document
    return torch.cat(pieces).int()[None]


def _step_fn(rank, world_size, method, mask, seq_len, threads, segments, rounds=1):
    torch.set_num_threads(threads)
    extra = dict(attention_mask="document", rope_positions="document") if mask == "document" else {}
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, max_seq_len=seq_len + 64, **extra)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], None
    docs = document_positions(segments) if mask == "document" else None
    if world_size > 1:
        meshes = build_meshes(ParallelDims(cp=world_size, dp_shard=1, world_size=world_size))
        layout = apply_context_parallel(
            model, meshes.cp, model.parallel_info()["attention_modules"],
            ContextParallelConfig(method, load_balance_rounds=rounds),
        )
        positions = layout.local_indices(rank, seq_len)
        if docs is not None:
            positions = shard_sequence(docs, 1, rank, layout)
        inputs, labels = shard_sequence(inputs, 1, rank, layout), shard_sequence(labels, 1, rank, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        logits = model(inputs, positions, docs) if docs is not None else model(inputs, positions)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _throughput(rank, world_size, method, mask, seq_len, steps, threads, segments, rounds):
    step = _step_fn(rank, world_size, method, mask, seq_len, threads, segments, rounds)
    step()  # warm-up
    times = []
    for _ in range(steps):
        if world_size > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", default="allgather,ring")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"Llama 3 debug, 2 layers, batch 1, fp32, {cores} cores, torch {torch.__version__}; documents "
          f"log-normal (median {MEDIAN}, sigma {SIGMA})")
    for seq_len in (int(s) for s in args.seqs.split(",")):
        segments = packed_rows(seq_len, 1)[0]
        causal_pairs = seq_len * (seq_len + 1) // 2
        doc_pairs = sum(n * (n + 1) // 2 for n in segments)
        print(f"\n## seq {seq_len}: {len(segments)} segments (longest {max(segments)}); document masking "
              f"computes {doc_pairs / causal_pairs:.1%} of causal attention's pairs "
              f"({1 - doc_pairs / causal_pairs:.1%} skipped)\n")
        print("| layout | causal tok/s | document tok/s | document / causal |")
        print("| --- | ---: | ---: | ---: |")
        configs = [(1, "none", 1)] + [(2, m, 1) for m in args.methods.split(",")] + [(2, "allgather", 4)]
        for cp, method, rounds in configs:
            tps = {}
            for mask in ("causal", "document"):
                threads = max(1, cores // cp)
                times = run_on_ranks(_throughput, cp, method, mask, seq_len, args.steps, threads, segments, rounds,
                                     timeout=3600)
                step_s = statistics.median(max(ts) for ts in zip(*times))
                tps[mask] = seq_len / step_s
            label = "1 rank" if cp == 1 else f"CP 2 {method}" + (f", {rounds} rounds" if rounds > 1 else "")
            print(f"| {label} | {tps['causal']:.0f} | {tps['document']:.0f} | "
                  f"{tps['document'] / tps['causal']:.2f} |", flush=True)

        batches = [packed_rows(seq_len, 8, seed=1 + i) for i in range(16)]
        print(f"\nAttention work per cp rank, max / mean over ranks, mean (worst) over 16 micro-batches of 8 "
              f"packed rows of seq {seq_len}:\n")
        print("| cp | causal, head-tail | document, head-tail (ours) | document, head-tail 4 rounds (ours) | "
              "document, contiguous | document, per-document head-tail (torchtitan) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        one_doc = [[seq_len]] * 8
        for cp in (2, 4, 8):
            strategies = [(SequenceLayout(cp, True), True), (SequenceLayout(cp, True), False),
                          (SequenceLayout(cp, True, rounds=4), False), (SequenceLayout(cp, False), False),
                          (PerDocumentHeadTail(cp), False)]  # fmt: skip
            cells = []
            for layout, causal in strategies:
                values = [imbalance(attention_work(layout, one_doc if causal else rows, seq_len)) for rows in batches]
                cells.append(f"{statistics.mean(values):.3f} ({max(values):.2f})")
            print(f"| {cp} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
