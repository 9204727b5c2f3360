"""A model too big for the ranks, refused by arithmetic before it is built.

Building a model on the meta device is linear in its depth: at 10^5 layers it takes minutes, all
before the memory check could say the run cannot fit. Past a depth no shipped flavor reaches,
the parameter count comes from models of one and two blocks (a block's count times the depth),
and a run whose fp32 weights alone, sharded over every rank, exceed one rank's memory is refused
at once; one that might fit goes on to the full build and the real estimate.
"""

import dataclasses
import os

import torch

from .config import Config, ConfigError

# Deeper than any shipped flavor (Llama 3 405B: 126 blocks): below it the meta build is quick.
BUILT_WITHOUT_BOUND = 192


def check_size_bound(config: Config, spec, model_args, world_size: int) -> None:
    depth = getattr(model_args, "n_layers", 0)
    depths = getattr(model_args, "mtp_layers", 0) or 0
    if depth + depths <= BUILT_WITHOUT_BOUND or not config.training.memory_check:
        return
    if torch.cuda.is_available() and "LOCAL_RANK" not in os.environ and world_size > 1:
        return  # the launcher must not touch CUDA; every rank checks its own GPU before building
    from .memory_estimate import GIB, device_memory

    count = parameter_count(spec, model_args)
    per_rank = count * 4 / world_size
    memory, where = device_memory(int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
    if per_rank > memory:
        raise ConfigError(
            f"model.n_layers = {depth}" + (f" and model.mtp_layers = {depths}" if depths else "") +
            f" make {config.model.name} {count / 1e9:.1f} B parameters: their fp32 weights alone are "
            f"{per_rank / GIB:.1f} GiB per rank sharded over all {world_size} ranks, but this rank has {where}: "
            "lower model.n_layers (or model.mtp_layers), or run on more ranks."
        )


def parameter_count(spec, model_args) -> int:
    """The model's parameter count from meta builds of one and two blocks: the parts outside the
    blocks, plus each kind of block (dense, MoE, MTP depth) times how many there are."""

    def count(**fields) -> int:
        with torch.device("meta"):
            model = spec.model_cls(dataclasses.replace(model_args, **fields))
        return sum(p.numel() for p in model.parameters())

    no_mtp = {"mtp_layers": 0} if hasattr(model_args, "mtp_layers") else {}
    depth = model_args.n_layers
    if hasattr(model_args, "n_dense_layers"):
        dense = min(model_args.n_dense_layers, depth)
        one_dense = count(n_layers=1, n_dense_layers=1, **no_mtp)
        per_dense = count(n_layers=2, n_dense_layers=2, **no_mtp) - one_dense
        per_moe = count(n_layers=2, n_dense_layers=1, **no_mtp) - one_dense
        outside = one_dense - per_dense
        total = outside + dense * per_dense + (depth - dense) * per_moe
        base, base_fields = one_dense, {"n_layers": 1, "n_dense_layers": 1}
    else:
        one = count(n_layers=1, **no_mtp)
        per_block = count(n_layers=2, **no_mtp) - one
        total = one + (depth - 1) * per_block
        base, base_fields = one, {"n_layers": 1}
    depths = getattr(model_args, "mtp_layers", 0) or 0
    if depths:
        total += depths * (count(**base_fields, mtp_layers=1) - base)
    return total
