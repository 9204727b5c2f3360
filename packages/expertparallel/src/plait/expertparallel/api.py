"""`apply_expert_parallel`: shard routed experts' E dimension over the ep mesh and route their
tokens through all-to-all dispatch / combine. Applied to an unmodified model, after tensor
parallel and before activation checkpointing, compile and data parallel."""

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from plait.mesh import ParallelConfigError

from .capacity import CapacityDispatcher
from .dispatch import AllToAllDispatcher


@dataclass(frozen=True)
class ExpertParallelConfig:
    capacity_factor: float = 0.0
    """0: dropless (uneven all-to-all, one host sync per layer). > 0: capacity mode, each (source
    rank, expert) pair sends at most ceil(factor x rows / experts) rows through a static all-to-all
    with no host sync; tokens beyond it are dropped (weight 0) and counted."""
    alignment: int | None = None
    """Rows per expert group are padded to a multiple of this for the grouped GEMM (None: 8 on
    CUDA, where grouped_mm wants aligned groups, 1 elsewhere)."""


def validate_expert_parallel(
    num_experts: int, ep: int, tp: int = 1, etp: int = 1, config: ExpertParallelConfig | None = None
) -> None:
    """Local checks, the same on every rank: call before any collective."""
    if config is not None and config.capacity_factor < 0:
        raise ParallelConfigError(
            f"parallelism.expert_capacity_factor = {config.capacity_factor}: use 0 (dropless) or a factor > 0."
        )
    if ep > 1 and num_experts % ep:
        raise ParallelConfigError(
            f"parallelism.ep = {ep} does not divide the {num_experts} routed experts: pick an ep that divides them."
        )
    if ep > 1 and tp > 1:
        raise ParallelConfigError(
            f"parallelism.ep = {ep} with parallelism.tp = {tp} is not supported yet (expert-tensor parallel and "
            "the sequence-parallel dispatch are not built): set tp = 1 or ep = 1."
        )


def _shard_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(name, sharded)


class _DispatchHooks:
    """Forward pre-hook: dispatch the module's inputs. Forward hook: combine its output."""

    def __init__(self, dispatcher: AllToAllDispatcher | CapacityDispatcher):
        self.dispatcher = dispatcher

    def before(self, module, args):
        x_ND, num_tokens_per_expert_E = args
        return self.dispatcher.dispatch(x_ND, num_tokens_per_expert_E)

    def after(self, module, args, y_padded_PD):
        return self.dispatcher.combine(y_padded_PD)


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, expert_modules: Sequence[str], config: ExpertParallelConfig | None = None
) -> dict[str, AllToAllDispatcher | CapacityDispatcher]:
    """Shard each routed-experts module (`parallel_info()["experts"]`: weights [E, in, out],
    `forward(routed_input_ND, num_tokens_per_expert_E)`, `permute_and_pad` / `unpermute` helpers)
    over `ep_mesh` on dim 0, and move its tokens with all-to-all. Returns the dispatcher of each
    module (their `host_syncs` counters)."""
    config = config or ExpertParallelConfig()
    ep = ep_mesh.size()
    dispatchers = {}
    for path in expert_modules:
        module = model.get_submodule(path)
        num_experts = next(module.parameters()).shape[0]
        validate_expert_parallel(num_experts, ep)
        for helper in ("permute_and_pad", "unpermute"):
            if not callable(getattr(module, helper, None)):
                raise ParallelConfigError(
                    f"expert module {path!r} ({type(module).__name__}) has no {helper}: it does not follow the "
                    "experts contract (docs/contracts.md)."
                )
        _shard_experts(module, ep_mesh)
        device = next(module.parameters()).device
        alignment = config.alignment or (8 if device.type == "cuda" else 1)
        if config.capacity_factor > 0:
            dispatcher = CapacityDispatcher(ep_mesh.get_group(), num_experts, config.capacity_factor)
        else:
            dispatcher = AllToAllDispatcher(
                ep_mesh.get_group(), num_experts, module.permute_and_pad, module.unpermute, alignment
            )
        hooks = _DispatchHooks(dispatcher)
        module.register_forward_pre_hook(hooks.before)
        module.register_forward_hook(hooks.after)
        dispatchers[path] = dispatcher
    return dispatchers


__all__ = ["ExpertParallelConfig", "apply_expert_parallel", "validate_expert_parallel"]
