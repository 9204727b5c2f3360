"""Model on meta -> tensor parallel -> context parallel -> expert parallel -> activation
checkpointing -> compile per block -> data parallel.

Initial weights are the same on every layout: with `full_init` (the default whenever the fp32
model fits in a few GiB) every rank materialises the whole model on its device, seeds the RNG
with job.seed and runs `init_weights()` before anything is sharded; tensor and data parallel
then shard those existing full tensors, so rank r's shard is exactly the slice of the 1-rank
model (parity from step 1). Models too large for that are parallelised on the meta device and
only their local shards are materialised and initialised (`init = "sharded"`).
"""

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from plait.mesh import Meshes, ParallelConfigError

from .activation_checkpoint import apply_activation_checkpointing
from .config import Config, ConfigError
from .fsdp_tp import fsdp_post_forward_first
from .validate import RunPlan, cp_config, ep_config, tp_config


@dataclass
class ParallelModel:
    model: nn.Module  # what to call (a DDP wrapper under replicate_impl = "ddp")
    inner: nn.Module  # the plait model itself
    dp_mode: str  # none, fsdp, hsdp, replicate, ddp
    autocast: contextlib.AbstractContextManager | None  # for forward + loss, or None
    loss_parallel: bool
    cp_layout: object | None = None  # plait.contextparallel.SequenceLayout the batch is sharded in
    dispatchers: dict | None = None  # expert parallel: module path -> token dispatcher
    stages: list | None = None  # pipeline parallel: this rank's plait.pipelineparallel Stages


def compile_kwargs(training) -> dict:
    """torch.compile's arguments for each block (`training.compile_mode`, `compile_comm_overlap`)."""
    if training.compile_mode != "default":
        return {"mode": training.compile_mode}  # torch takes a mode or inductor options, not both
    return {"options": {"reorder_for_compute_comm_overlap": True}} if training.compile_comm_overlap else {}


def _dtype(config: Config) -> torch.dtype:
    return torch.bfloat16 if config.training.dtype == "bfloat16" else torch.float32


def _explicit_prefetch(config: Config, device_type: str | None) -> bool:
    policy = config.parallelism.fsdp_prefetch
    if policy == "auto":
        # CPU has no streams, so no implicit prefetch: plait.dataparallel issues gloo's all-gathers
        # async there, and only an explicit prefetch starts one before its block needs it.
        return config.parallelism.ep > 1 or device_type == "cpu"
    return policy == "explicit"


def data_parallel_config(config: Config, device_type: str | None = None):
    """`device_type`: where the run trains ("cpu", "cuda"); it decides fsdp_prefetch = auto."""
    from plait.dataparallel import DataParallelConfig

    dtype = _dtype(config)
    return DataParallelConfig(
        param_dtype=dtype if dtype != torch.float32 else None,
        reduce_dtype=torch.float32,
        reshard_after_forward=config.parallelism.reshard_after_forward,
        replicate_impl=config.parallelism.replicate_impl,
        prefetch=_explicit_prefetch(config, device_type),
    )


def _init(model: nn.Module, device: torch.device, seed: int) -> None:
    model.to_empty(device=device)
    # Same seed on every rank and layout: init draws the same numbers for the same full tensors.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        model.init_weights(buffer_device=device)


def parallelize(config: Config, plan: RunPlan, meshes: Meshes, device: torch.device) -> ParallelModel:
    """Apply every parallelism in the fixed order; the packages' own local checks (the same on
    every rank, before their first collective, all ParallelConfigError) surface as ConfigError."""
    try:
        return _parallelize(config, plan, meshes, device)
    except ParallelConfigError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _parallelize(config: Config, plan: RunPlan, meshes: Meshes, device: torch.device) -> ParallelModel:
    from plait.dataparallel import apply_data_parallel, autocast_context
    from plait.dataparallel.config import data_parallel_mode

    if meshes.dims.pp > 1:
        from .pipeline import parallelize_pipeline

        return parallelize_pipeline(config, plan, meshes, device)
    model, info = plan.model, plan.info
    blocks = list(info["blocks"])
    if plan.full_init:
        _init(model, device, config.job.seed)

    loss_parallel = False
    if meshes.dims.tp > 1:
        tp = plan.parallel_modules["tp"]
        tp_cfg = tp_config(tp, config)
        if meshes.dims.ep > 1 and meshes.dims.etp == 1:
            # Expert parallel keeps these experts whole (etp = 1) and owns them.
            tp_cfg = replace(tp_cfg, external_modules=tuple(info["experts"]))
        tp.apply_tensor_parallel(model, meshes.tp, info["tp_plan"], tp_cfg)
        loss_parallel = tp.uses_loss_parallel(info["tp_plan"], tp_cfg, meshes.dims.tp)
    cp_layout, dispatchers = None, None
    if meshes.dims.cp > 1:
        cp = plan.parallel_modules["cp"]
        cp_layout = cp.apply_context_parallel(model, meshes.cp, info["attention_modules"], cp_config(cp, config, info))
    if meshes.dims.ep > 1:
        # dp2ep: routed experts sharded on E over the ep ranks (borrowed from dp_shard x cp); data
        # parallel then shards them over what is left (efsdp).
        ep = plan.parallel_modules["ep"]
        dispatchers = ep.apply_expert_parallel(
            model, meshes.ep, info["experts"], ep_config(ep, config), tp_mesh=meshes.tp, ep_etp_mesh=meshes.ep_etp,
            overlap_modules=info.get("expert_overlap"),
        )

    apply_activation_checkpointing(
        model, blocks, config.training.activation_checkpoint, config.training.activation_checkpoint_every
    )
    if config.training.compile:
        for path in blocks:
            model.get_submodule(path).compile(**compile_kwargs(config.training))

    dp_config = data_parallel_config(config, device.type)
    dp_mode = data_parallel_mode(meshes.dims, dp_config)
    wrapped = apply_data_parallel(
        model, meshes, blocks, dp_config, expert_modules=info.get("experts", ()),
        edge_units=info.get("edge_units", ()) if dp_mode in ("fsdp", "hsdp") else (),
    )
    if meshes.dims.tp > 1 and dp_mode in ("fsdp", "hsdp"):
        fsdp_post_forward_first(model)  # no "returned a view tensor" warning (fsdp_tp.py)
    if not plan.full_init:
        if device.type == "cpu" and meshes.dims.world_size > 1 and not config.checkpoint.initial_load_path:
            # DTensor's random ops need a device RNG with offsets (CUDA-like); on CPU every rank
            # would draw the same numbers for its own shard.
            print(
                "plait-train: warning: model.init = sharded on CPU gives every shard the same random "
                "numbers; use model.init = full, or start from a seed checkpoint "
                "(--checkpoint.create_seed_checkpoint, then --checkpoint.initial_load_path).",
                flush=True,
            )
        _init(model, device, config.job.seed)

    autocast = None
    dtype = _dtype(config)
    if dtype != torch.float32:
        if meshes.dims.world_size == 1:
            autocast = autocast_context(meshes, dp_config, device.type)
        elif dp_mode == "none":
            # Tensor parallel alone has no sharding policy to cast parameters: autocast instead.
            autocast = torch.autocast(device.type, dtype=dtype)
    return ParallelModel(wrapped, model, dp_mode, autocast, loss_parallel, cp_layout, dispatchers)
