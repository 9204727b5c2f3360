"""Pipeline parallel in plait-train: cut the model into this rank's stages, parallelise each stage
module as parallelize.py does the whole model, and see the stages as one model for everything
that reads parameters by name (optimizer, checkpoints, gradient clipping, MoE balancing).

Initial weights: with `full_init` the whole model is materialised and initialised with job.seed
first, then cut, so every stage holds exactly the one-rank model's weights (parity from step 1).
Sharded init (`model.init = sharded`) initialises each stage module on its own: its draws differ
from the one-rank model's (start from a seed checkpoint for parity).
"""

from dataclasses import replace
from fnmatch import fnmatchcase

import torch
from torch import nn

from plait.mesh import Meshes

from .activation_checkpoint import apply_activation_checkpointing
from .config import Config
from .fsdp_tp import fsdp_post_forward_first
from .validate import RunPlan


class StageUnion(nn.Module):
    """This rank's stage modules as one module with the unsplit model's FQNs.

    Stage modules keep the whole model's paths (their blocks in a ModuleDict keyed by block index,
    absent edge units None), so the union registers the same submodules under the same names:
    ModuleDicts are merged, every other child and root buffer comes from the stage that holds it.
    Its parameters are exactly this rank's; it is never called (the pipeline runs the stages).
    """

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.stage_modules = modules  # a plain list: not registered, so not part of the FQNs
        # The model's arguments, as the whole model has them (checkpoint markers, HF export).
        self.args = getattr(modules[0], "args", None)
        for module in modules:
            for name, child in module.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, nn.ModuleDict())
                    for key, sub in child.items():
                        self._modules[name][key] = sub
                elif name not in self._modules:
                    self.add_module(name, child)
            for name, buf in module.named_buffers(recurse=False):
                if name not in self._buffers:
                    self.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
            for name, param in module.named_parameters(recurse=False):
                if name not in self._parameters:
                    self.register_parameter(name, param)

    def flops_per_token(self, seq_len: int) -> float:
        return self.stage_modules[0].flops_per_token(seq_len)  # counted from the model's args

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline's stages run through the schedule (Trainer.pipeline), not StageUnion")


def _owned(paths, module: nn.Module) -> list[str]:
    """The paths among `paths` that exist in `module` (a stage holds some blocks only)."""
    names = {name for name, _ in module.named_modules()}
    return [p for p in paths if p in names]


def _stage_plan(plan: dict, module: nn.Module) -> dict:
    """The tensor-parallel plan entries whose patterns match a module of this stage (a pattern
    matching nothing is an error in plait-tensorparallel; other stages' blocks are absent here)."""
    paths = [name.split(".") for name, _ in module.named_modules() if name]

    def matches(pattern: str) -> bool:
        parts = pattern.split(".")
        return any(len(p) == len(parts) and all(fnmatchcase(a, b) for a, b in zip(p, parts)) for p in paths)

    return {pattern: style for pattern, style in plan.items() if matches(pattern)}


def _tensor_and_expert_parallel(config: Config, plan: RunPlan, meshes: Meshes, module: nn.Module):
    """TP, CP and EP on one stage module, as parallelize.py does on the whole model: (loss parallel,
    the CP sequence layout, the EP dispatchers)."""
    from .validate import cp_config, ep_config, tp_config

    info, dims = plan.info, meshes.dims
    loss_parallel, cp_layout, dispatchers = False, None, {}
    if dims.tp > 1:
        tp = plan.parallel_modules["tp"]
        tp_cfg = tp_config(tp, config)
        if dims.ep > 1 and dims.etp == 1:
            tp_cfg = replace(tp_cfg, external_modules=tuple(info["experts"]))
        stage_plan = _stage_plan(info["tp_plan"], module)
        tp.apply_tensor_parallel(module, meshes.tp, stage_plan, tp_cfg)
        loss_parallel = tp.uses_loss_parallel(info["tp_plan"], tp_cfg, dims.tp)
    if dims.cp > 1:
        cp = plan.parallel_modules["cp"]
        cp_layout = cp.apply_context_parallel(
            module, meshes.cp, _owned(info["attention_modules"], module), cp_config(cp, config, info)
        )
    experts = _owned(info.get("experts", ()), module)
    if dims.ep > 1 and experts:
        ep = plan.parallel_modules["ep"]
        overlap = {k: v for k, v in info.get("expert_overlap", {}).items() if k in experts}
        dispatchers = ep.apply_expert_parallel(
            module, meshes.ep, experts, ep_config(ep, config), tp_mesh=meshes.tp, ep_etp_mesh=meshes.ep_etp,
            overlap_modules=overlap,
        )
    return loss_parallel, cp_layout, dispatchers


def parallelize_pipeline(config: Config, plan: RunPlan, meshes: Meshes, device: torch.device):
    """The stages of this rank, each data parallel (and checkpointed / compiled) as configured."""
    from plait.dataparallel import apply_data_parallel
    from plait.dataparallel.config import data_parallel_mode

    from .parallelize import ParallelModel, _dtype, _init, compile_kwargs, data_parallel_config

    pp_module = plan.parallel_modules["pp"]
    p = config.parallelism
    model, info = plan.model, plan.info
    if plan.full_init:
        _init(model, device, config.job.seed)
    stages = pp_module.split_stages(
        model, info, p.pp, meshes.pp_rank, list(p.layers_per_stage) or None, p.pipeline_virtual_stages,
        pp_module.schedule_style(p.pipeline_schedule),
    )
    if plan.full_init:
        model.to_empty(device="meta")  # the stages hold copies; the whole model is only a description now

    # Micro-batches reuse the gathered parameters between their forward and backward, and torch
    # 2.13's zero-bubble schedules lose weight gradients when FSDP reshards after forward.
    dp_config = replace(data_parallel_config(config), reshard_after_forward="never")
    dp_mode = data_parallel_mode(meshes.dims, dp_config)
    loss_parallel, cp_layout, dispatchers = False, None, {}
    for stage in stages:
        module = stage.module
        stage_loss_parallel, stage_layout, stage_dispatchers = _tensor_and_expert_parallel(config, plan, meshes, module)
        loss_parallel = loss_parallel or stage_loss_parallel
        cp_layout = stage_layout if stage_layout is not None else cp_layout  # the same on every stage
        dispatchers.update(stage_dispatchers)
        apply_activation_checkpointing(
            module, stage.blocks, config.training.activation_checkpoint, config.training.activation_checkpoint_every
        )
        if config.training.compile:
            for path in stage.blocks:
                module.get_submodule(path).compile(**compile_kwargs(config.training))
        apply_data_parallel(
            module, meshes, stage.blocks, dp_config, expert_modules=_owned(info.get("experts", ()), module),
            edge_units=stage.edge_units if dp_mode in ("fsdp", "hsdp") else (),
        )
        if meshes.dims.tp > 1 and dp_mode in ("fsdp", "hsdp"):
            fsdp_post_forward_first(module)  # no "returned a view tensor" warning (fsdp_tp.py)
        if not plan.full_init:
            _init(module, device, config.job.seed)

    union = StageUnion([s.module for s in stages])
    autocast = None
    if _dtype(config) != torch.float32 and dp_mode == "none":
        # No sharding policy casts parameters: autocast, as the one-rank run does.
        autocast = torch.autocast(device.type, dtype=_dtype(config))
    return ParallelModel(union, union, dp_mode, autocast, loss_parallel, cp_layout, dispatchers or None, stages=stages)


def build_trainer_pipeline(config: Config, plan: RunPlan, meshes: Meshes, pm, loss_fn, moe, device):
    """torch's schedule over the stages: `loss_fn` the summed token loss, MoE aux losses per stage."""
    from .validate import pipeline_microbatches

    pp_module = plan.parallel_modules["pp"]
    n_mb = pipeline_microbatches(config)
    aux = None
    if moe is not None and moe.aux_enabled:
        def aux(module):  # each micro-batch's balance loss, averaged like the accumulation's
            return moe.aux_loss(module) / n_mb
    return pp_module.build_pipeline(
        pm.stages, meshes.pp.get_group(), config.parallelism.pipeline_schedule, n_mb, loss_fn, device, aux_loss=aux
    )


def merge_micro_batches(micro_batches: list[tuple]) -> list[tuple]:
    """The accumulation micro-batches as one local batch (the pipeline splits it into its own
    micro-batches): (inputs, labels, document_positions) concatenated along the batch."""
    if len(micro_batches) == 1:
        return micro_batches
    columns = list(zip(*micro_batches))
    return [tuple(None if col[0] is None else torch.cat(col) for col in columns)]
