"""The DTensor parallel styles behind the plan strings that torch does not ship as is.

Models are plain PyTorch, so every module boundary hands over *local* tensors. Inside a block,
the hidden state is replicated over the TP ranks while the work on it is split (heads, hidden
units, experts). Gradients there follow one rule, Megatron's:

    inside a TP region the gradient of a replicated activation is a per-rank *partial sum*.

A region is opened by `prepare_input` / `moe_input_output` on the block's attention / FFN / MoE
module; its entry reduces those partial gradients once (reduce-scatter under sequence parallel,
all-reduce otherwise). Every style inside a region keeps the rule:

- `colwise` leaves its input gradient partial (no all-reduce per projection);
- `replicate` (replicated weights, redundant compute) all-reduces its output gradient, computes
  its own backward on complete gradients (so its weight gradients are complete, Replicate), and
  hands back its input gradient as a partial sum again;
- `head_norm` (replicated weights on each local head, e.g. Qwen3's `q_norm` on a `colwise`
  output) leaves its input gradient as is (the heads are this rank's) and sums its weight
  gradient over the TP ranks.

Any mix of consumers then works with no knowledge of the model: MLA's shared rotary key (used by
every local head), a router whose scores weight TP-partial expert outputs, shared experts.
"""

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from .call_checks import check_full_sequence, mark_local_heads, refuse_local_heads

_PARTIAL = (Partial(),)
_REPLICATE = (Replicate(),)


def _position_of(module: nn.Module, argument: str) -> int | None:
    """Index of `argument` among `module.forward`'s positional parameters (None: keyword only / unknown)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(argument) if argument in positional else None


def enter_region(x: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """`layout` (Shard(1) or Replicate) -> replicated local tensor whose gradient is a partial sum."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    # Backward: the partial local gradients become a Partial DTensor, reduce-scattered back to
    # Shard(1) (or all-reduced to Replicate) by the redistribute's backward.
    return x.redistribute(mesh, _REPLICATE).to_local(grad_placements=_PARTIAL)


def leave_region(y: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> torch.Tensor:
    """A per-rank partial sum -> `layout` (Shard(1): reduce-scatter, Replicate: all-reduce), local."""
    if isinstance(y, DTensor):
        y = y.to_local()
    return DTensor.from_local(y, mesh, _PARTIAL, run_check=False).redistribute(mesh, (layout,)).to_local()


class RegionInput(ParallelStyle):
    """`prepare_input` / `moe_input_output`: open a TP region on the module's hidden-state input.

    That input is the first positional argument, or with `argument` the one of that name, passed
    by position or by keyword (transformers calls `self_attn(hidden_states=...)`). Other arguments
    pass through untouched: they must already be what every TP rank needs whole (e.g. RoPE
    cos / sin of the full sequence; inside the region the sequence is gathered).

    With `output_layout`, the module's output is a partial sum over TP ranks (MoE: TP-sharded
    experts plus row-wise shared experts) and is reduced to `output_layout` on the way out.
    """

    def __init__(
        self,
        input_layout: Placement,
        output_layout: Placement | None = None,
        argument: str | None = None,
        entry: str = "",
    ):
        super().__init__()
        self.input_layout = input_layout
        self.output_layout = output_layout
        self.argument = argument
        self.entry = entry  # the plan entry (module path), for errors at call time

    def _plan_string(self) -> str:
        name = "prepare_input" if self.output_layout is None else "moe_input_output"
        return name if self.argument is None else f"{name}({self.argument})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        position = 0 if self.argument is None else _position_of(module, self.argument)

        def enter(x):
            return enter_region(x, device_mesh, self.input_layout)

        def pre_hook(mod, args, kwargs):
            if self.argument is not None and self.argument in kwargs:
                x, others = kwargs[self.argument], {k: v for k, v in kwargs.items() if k != self.argument}
                self._check_tensor(mod, x, device_mesh, args, others)
                return args, {**kwargs, self.argument: enter(x)}
            if position is None or len(args) <= position:
                self._missing(mod, args, kwargs)
            self._check_tensor(mod, args[position], device_mesh, (*args[:position], *args[position + 1 :]), kwargs)
            return (*args[:position], enter(args[position]), *args[position + 1 :]), kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if self.output_layout is not None:
            module.register_forward_hook(lambda mod, args, out: leave_region(out, device_mesh, self.output_layout))
        return module

    def _where(self, mod: nn.Module) -> str:
        entry = f"plan entry {self.entry!r}: " if self.entry else ""
        return f"{entry}{self._plan_string()!r} on {type(mod).__name__}"

    def _missing(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.argument is None:
            raise TypeError(
                f"{self._where(mod)} converts the first positional argument (the hidden state), but the module "
                f"was called without one (keywords: {', '.join(kwargs) or 'none'}); name the argument in the "
                "plan, e.g. 'prepare_input(hidden_states)'."
            )
        raise TypeError(
            f"{self._where(mod)} converts argument {self.argument!r}, but the module was called without it "
            f"({len(args)} positional, keywords: {', '.join(kwargs) or 'none'}); name the argument that "
            "carries the hidden state."
        )

    def _check_tensor(self, mod: nn.Module, x, mesh: DeviceMesh, other_args: tuple, other_kwargs: dict) -> None:
        if not isinstance(x, torch.Tensor):
            what = "the first positional argument" if self.argument is None else f"argument {self.argument!r}"
            raise TypeError(
                f"{self._where(mod)} converts {what}, but got {type(x).__name__}, not the hidden-state tensor."
            )
        if self.input_layout.is_shard(1) and not isinstance(x, DTensor) and x.ndim >= 2:
            check_full_sequence(self.entry, x.shape[1], x.shape[1] * mesh.size(), other_args, other_kwargs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layout={self.input_layout}, output_layout={self.output_layout}, "
            f"argument={self.argument})"
        )


class RegionColwise(ColwiseParallel):
    """`colwise` inside a region: weight Shard(0); the input gradient is left a partial sum; the
    local output is tagged as this rank's heads (a `replicate` module refuses it, call_checks.py)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        y = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return mark_local_heads(y)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor):
            return x.redistribute(device_mesh, _REPLICATE)
        return DTensor.from_local(x, device_mesh, _REPLICATE, run_check=False, grad_placements=_PARTIAL)


class VocabShardedLossHead(ParallelStyle):
    """`loss_head`: an output projection fused with its loss (a module with `weight` [V, D] that
    returns each token's loss and, given a DTensor weight, computes it vocab-parallel itself, with
    its own collective). The weight is sharded on the vocabulary (Shard(0)); the hidden-state input
    (`input_layout`: Shard(1) under SP, else Replicate) is gathered to a replicated local tensor
    whose gradient is a per-rank partial sum (each rank's vocabulary rows contribute), reduced back
    on the way out as in a region; the output, the same on every TP rank, passes as it is."""

    def __init__(self, input_layout: Placement):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_vocab(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, mesh, (Shard(0),)), requires_grad=param.requires_grad)
                mod.register_parameter(pname, sharded)

        def input_fn(mod, inputs, mesh):
            return (enter_region(inputs[0], mesh, self.input_layout), *inputs[1:])

        return distribute_module(module, device_mesh, shard_vocab, input_fn)


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    # Parameters only (recurse=False: distribute_module visits every submodule); buffers such as a
    # router's expert bias stay plain tensors the model updates itself.
    for pname, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            dist = nn.Parameter(distribute_tensor(param, mesh, _REPLICATE), requires_grad=param.requires_grad)
            module.register_parameter(pname, dist)


class ReplicateCompute(ParallelStyle):
    """`replicate`: replicated parameters (Replicate DTensors), computed redundantly inside a region.

    Input: a replicated local tensor with partial-sum gradient. Output: the same. In backward the
    output gradient is all-reduced first, so the module's own backward (and its weight gradients)
    sees complete gradients; its input gradient is split back into equal partial shares. A `colwise`
    output (this rank's heads) is refused: that is `head_norm`'s job.
    """

    def __init__(self, entry: str = ""):
        super().__init__()
        self.entry = entry  # the plan entry (module path), for errors at call time

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            refuse_local_heads(self.entry, "replicate", inputs)
            return tuple(
                DTensor.from_local(x, mesh, _REPLICATE, run_check=False, grad_placements=_PARTIAL)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.is_floating_point()
                else x
                for x in inputs
            )

        def output_fn(mod, outputs, mesh):
            return _map_tensors(outputs, lambda y: _all_reduce_grad(y, mesh))

        return distribute_module(module, device_mesh, _replicate_params, input_fn, output_fn)


def _all_reduce_grad(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Forward: the local replica. Backward: the partial local gradients are summed over `mesh`."""
    if not isinstance(y, DTensor):
        return y
    # to_local(grad_placements=Partial) labels the incoming gradient a partial sum; from_local's
    # backward (grad_placements=Replicate) all-reduces it before y's own backward runs.
    replica = DTensor.from_local(y.to_local(), mesh, _REPLICATE, run_check=False, grad_placements=_REPLICATE)
    return replica.to_local(grad_placements=_PARTIAL)


def _map_tensors(outputs, fn):
    if isinstance(outputs, torch.Tensor):
        return fn(outputs)
    if isinstance(outputs, tuple):
        return tuple(_map_tensors(o, fn) for o in outputs)
    if isinstance(outputs, list):
        return [_map_tensors(o, fn) for o in outputs]
    return outputs


class ReplicatedNorm(ParallelStyle):
    """`sequence_parallel` without sequence parallel: a norm on the replicated residual stream.

    Parameters become Replicate DTensors so every parameter of a TP model lives on the tp mesh
    (what FSDP + TP expects); the computation is plain replicated compute with complete gradients.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, _REPLICATE, run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_fn(mod, outputs, mesh):
            return _map_tensors(outputs, lambda y: y.to_local() if isinstance(y, DTensor) else y)

        return distribute_module(module, device_mesh, _replicate_params, input_fn, output_fn)


class ExpertsTensorParallel(ParallelStyle):
    """`experts_tp`: routed grouped experts (`w1, w3 [E, dim, hidden]`, `w2 [E, hidden, dim]`) with
    the hidden dim sharded over TP, for runs without expert parallel. The experts compute on their
    local shards (plait's GroupedExperts calls `to_local()`), so their output is a partial sum, which
    the enclosing `moe_input_output` reduces.
    """

    HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, dim in self.HIDDEN_DIM.items():
            param = getattr(module, pname)
            dist = nn.Parameter(distribute_tensor(param, device_mesh, (Shard(dim),)), requires_grad=param.requires_grad)
            module.register_parameter(pname, dist)
        return module


class SequenceParallelNorm(SequenceParallel):
    """`sequence_parallel` under SP: torch's SequenceParallel (replicated weights, input and output
    Shard(1)), handing local tensors on, with each weight gradient reduced as soon as it is computed.

    A norm on a sequence shard gives a Partial weight gradient; left so, every optimizer op and
    the norm for clipping would all-reduce it again. (FSDP replaces these parameters and reduces
    their gradients itself; the hook then simply no longer fires.)
    """

    def __init__(self):
        super().__init__(sequence_dim=1, use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module._plait_replicates_grads = True  # apply_tensor_parallel re-hooks replaced parameters
        hook_replicate_grads(module)
        return module


class HeadNorm(ParallelStyle):
    """`head_norm`: replicated weights applied to each of this rank's heads (Qwen3's `q_norm` /
    `k_norm`, RMSNorm over head_dim on a `colwise` output), computed locally, no communication.

    The input is a local piece of the heads, so each rank's weight gradient sums over its own heads
    only: the sum over TP ranks is the single-process gradient. DTensor is told the input is
    Shard(0) (any dim but the normalised last one gives the same local compute), which makes the
    weight gradient a Partial sum; it is reduced to Replicate as computed, as for
    `SequenceParallelNorm` (FSDP, when applied, reduces it itself). Output: the local tensor, still
    this rank's heads (tagged as a `colwise` output is).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, (Shard(0),), run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_fn(mod, outputs, mesh):
            return _map_tensors(outputs, lambda y: mark_local_heads(y.to_local() if isinstance(y, DTensor) else y))

        distribute_module(module, device_mesh, _replicate_params, input_fn, output_fn)
        module._plait_replicates_grads = True  # apply_tensor_parallel re-hooks replaced parameters
        hook_replicate_grads(module)
        return module


def hook_replicate_grads(module: nn.Module) -> None:
    """Reduce each of `module`'s parameters' Partial gradients to Replicate as computed, once per
    Parameter object (`to_empty` and `load_state_dict(assign=True)` make new ones, without hooks)."""
    for param in module.parameters():
        if not param.requires_grad or getattr(param, "_plait_replicate_grad_hooked", False):
            continue
        hooks = param._backward_hooks
        if hooks is not None and any(hook is _replicate_grad for hook in hooks.values()):
            # `to_empty` swapped a new tensor into this Parameter (torch.utils.swap_tensors): the
            # flag went with the old one's __dict__, and the hook dict stayed here but is no longer
            # registered with autograd (no hook in it fires). Register its hooks afresh.
            param._backward_hooks = None
            for hook in hooks.values():
                param.register_hook(hook)
        else:
            param.register_hook(_replicate_grad)
        param._plait_replicate_grad_hooked = True


def _replicate_grad(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, _REPLICATE * grad.device_mesh.ndim)
    return grad
