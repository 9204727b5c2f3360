"""Peak parameter memory per rank under FSDP with and without the embedding and the output head as
units of their own (`parallel_info()["edge_units"]`), on a mid-size flavor.

    python benchmarks/bench_fsdp_edge_units.py                  # Llama 3 1B shapes, 2 layers, FSDP 2
    python benchmarks/bench_fsdp_edge_units.py --layers 4 --ranks 4

Llama 3 1B's vocabulary (128256 x 2048) makes the embedding and the head 2 x 263M parameters,
more than its 16 blocks together, so this is where a root unit costs most. Every module's forward
and backward hooks sample the bytes of parameters FSDP holds unsharded at that moment (plain
tensors, not DTensor shards) plus the shards; the peak is the parameter memory of one training
step (forward + backward), fp32, measured on 2 CPU ranks.
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.models.llama3 import FLAVORS, Transformer
from plait.testing import run_on_ranks

GiB = 2**30


def _param_bytes(model) -> int:
    total = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            local = param.to_local() if isinstance(param, DTensor) else param
            total += local.numel() * local.element_size()
    return total


def _peak(rank, world_size, layers, edge):
    args = dataclasses.replace(FLAVORS["1B"], n_layers=layers, max_seq_len=128, tie_embeddings=False)
    with torch.device("meta"):
        model = Transformer(args)
    info = model.parallel_info()
    meshes = build_meshes(ParallelDims(dp_shard=world_size, world_size=world_size))
    units = info["edge_units"] if edge else ()
    model = apply_data_parallel(model, meshes, info["blocks"], DataParallelConfig(), edge_units=units)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], _param_bytes(model))

    for module in model.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
        module.register_full_backward_pre_hook(sample)
        module.register_full_backward_hook(sample)
    tokens = torch.randint(0, args.vocab_size, (1, 129), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    sample()
    return peak[0], _param_bytes(model)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    a = parser.parse_args()
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(FLAVORS["1B"], n_layers=a.layers, max_seq_len=128, tie_embeddings=False))
    total = sum(p.numel() for p in model.parameters())
    print(f"Llama 3 1B shapes, {a.layers} layers ({total / 1e6:.0f}M params, fp32 {total * 4 / GiB:.2f} GiB), "
          f"FSDP {a.ranks}, one forward + backward")
    print("\n| units | peak parameter memory per rank (GiB) | sharded at rest (GiB) |")
    print("| --- | ---: | ---: |")
    results = {}
    for edge in (False, True):
        peak, rest = max(run_on_ranks(_peak, a.ranks, a.layers, edge, timeout=1200))
        results[edge] = peak
        label = "blocks + root (embedding and head in the root)" if not edge else "blocks + embedding + [norm, head] + root"
        print(f"| {label} | {peak / GiB:.3f} | {rest / GiB:.3f} |", flush=True)
    print(f"\nedge units / root: {results[True] / results[False]:.2f} of the peak parameter memory")


if __name__ == "__main__":
    main()
