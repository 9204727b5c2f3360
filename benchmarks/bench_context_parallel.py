"""Context parallel on this machine: peak memory per rank and tokens/s, cp 1 vs 2 vs 4, each method.

    python benchmarks/bench_context_parallel.py                 # seq 8192, Llama 3 debug (2 layers)
    python benchmarks/bench_context_parallel.py --seq-len 16384 --layers 6 --steps 4

Memory: one forward + backward per configuration under torch's MemTracker (categories per rank:
parameters, gradients, activations, temporaries) at a fixed total sequence; the activation +
temporary part should fall close to 1/cp. Throughput: the same training step (forward, backward,
AdamW) timed on the same total cores — cp 1 is one process with all the threads, cp N is N ranks
with one thread each — so the ratio is what sharding the sequence costs or gains here. All runs
are in this one script; ratios are against the cp 1 run of the same invocation. No FSDP: the
parameters are replicated, so only the sequence-dependent memory changes with cp.
"""

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.nn.functional as F

from plait.contextparallel import ContextParallelConfig, apply_context_parallel, shard_sequence
from plait.mesh import ParallelDims, build_meshes
from plait.models.llama3 import FLAVORS, Transformer
from plait.testing import run_on_ranks

GiB = 2**30


def _model(layers: int, seq_len: int):
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=layers, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model, args


def _step_fn(rank, world_size, method, layers, seq_len, threads):
    """Build the model (with CP when world_size > 1); return a closure running one training step."""
    torch.set_num_threads(threads)
    model, args = _model(layers, seq_len)
    tokens = torch.randint(0, args.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], None
    if world_size > 1:
        meshes = build_meshes(ParallelDims(cp=world_size, dp_shard=1, world_size=world_size))
        layout = apply_context_parallel(
            model, meshes.cp, model.parallel_info()["attention_modules"], ContextParallelConfig(method)
        )
        positions = layout.local_indices(rank, seq_len)
        inputs, labels = shard_sequence(inputs, 1, rank, layout), shard_sequence(labels, 1, rank, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def forward_backward():
        logits = model(inputs, positions)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()

    def step():
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, forward_backward, step


def _memory(rank, world_size, method, layers, seq_len):
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer, forward_backward, step = _step_fn(rank, world_size, method, layers, seq_len, 1)
    step()  # optimizer state exists, as in a real step
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        forward_backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(getattr(k, "value", k)).lower(): v for k, v in peak.items()}


def _throughput(rank, world_size, method, layers, seq_len, steps, threads):
    _, _, _, step = _step_fn(rank, world_size, method, layers, seq_len, threads)
    step()  # warm-up
    times = []
    for _ in range(steps):
        if world_size > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _row(label, peak, base):
    act = peak.get("activation", 0) + peak.get("temp", 0)
    base_act = base.get("activation", 0) + base.get("temp", 0)
    return (
        f"| {label} | {peak.get('total', 0) / GiB:.3f} "
        f"| {(peak.get('parameter', 0) + peak.get('gradient', 0) + peak.get('optstate', 0)) / GiB:.3f} "
        f"| {act / GiB:.3f} | {act / base_act:.2f} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--methods", default="allgather,ring,ulysses")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    cps = [int(c) for c in args.cps.split(",")]
    methods = args.methods.split(",")
    configs = [(1, "none")] + [(cp, m) for cp in cps if cp > 1 for m in methods]

    print(f"Llama 3 debug, {args.layers} layers, seq_len {args.seq_len}, batch 1, fp32, {cores} cores, torch {torch.__version__}")
    print("\n## Peak memory per rank, one forward + backward (MemTracker; GiB)\n")
    print("| cp x method | total | params + grads + optimizer | activations + temps | act. vs cp 1 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = None
    for cp, method in configs:
        peaks = run_on_ranks(_memory, cp, method, args.layers, args.seq_len, timeout=1200)
        peak = max(peaks, key=lambda p: p.get("total", 0))
        base = base or peak
        print(_row(f"{cp} x {method}" if cp > 1 else "1 (no CP)", peak, base), flush=True)

    print(f"\n## Training step (forward, backward, AdamW), {cores} cores in all (medians of {args.steps} steps)\n")
    print("| cp x method | step s | tokens/s | vs cp 1 |")
    print("| --- | ---: | ---: | ---: |")
    base_s = None
    for cp, method in [c for c in configs if c[0] <= cores]:
        threads = max(1, cores // cp)
        times = run_on_ranks(_throughput, cp, method, args.layers, args.seq_len, args.steps, threads, timeout=1800)
        step_s = statistics.median(max(ts) for ts in zip(*times))  # a step ends when its slowest rank does
        base_s = base_s or step_s
        label = f"{cp} x {method}" if cp > 1 else "1 (no CP)"
        print(f"| {label} | {step_s:.2f} | {args.seq_len / step_s:.0f} | {base_s / step_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
