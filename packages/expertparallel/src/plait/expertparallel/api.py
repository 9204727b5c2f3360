"""`apply_expert_parallel`: shard routed experts' E dimension over the ep mesh and route their
tokens through all-to-all dispatch / combine. Applied to an unmodified model, after tensor
parallel and before activation checkpointing, compile and data parallel.

With tensor parallel the MoE is a TP region (every TP rank holds the same routed rows):
- etp = 1: the ep ranks include the TP ranks; the experts are whole, and each TP rank dispatches
  only its share of the rows (`token_split.py`), so no token is sent tp times;
- etp = tp: tensor parallel has already split the experts' hidden dim (`experts_tp`); they become
  DTensors on the 2-D (ep, etp) mesh, `(Shard(0), Shard(hidden))`, and every TP rank dispatches
  all rows to its ep peers, whose partial outputs the region's exit sums.
"""

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from plait.mesh import ParallelConfigError

from .capacity import CapacityDispatcher
from .dispatch import AllToAllDispatcher
from .token_split import RowShare, counts_in_share, restore_share, row_share, take_share


@dataclass(frozen=True)
class ExpertParallelConfig:
    capacity_factor: float = 0.0
    """0: dropless (uneven all-to-all, one host sync per layer). > 0: capacity mode, each (source
    rank, expert) pair sends at most ceil(factor x rows / experts) rows through a static all-to-all
    with no host sync; tokens beyond it are dropped (weight 0) and counted."""
    capacity_rows: int | None = None
    """Capacity mode: the routed rows per micro-batch the capacity is sized by, the same on every
    ep rank by construction (e.g. local batch x seq_len / cp x top_k). None: the rows each rank
    routes, checked equal over the ep ranks before the first all-to-all (one host sync per MoE
    layer, again only if the count changes) unless `rows_equal_by_construction`."""
    rows_equal_by_construction: bool = False
    """Capacity mode: the caller guarantees every ep rank routes the same rows in every micro-batch
    (the trainer: fixed [local_batch_size, seq_len] micro-batches, cp shards of equal length), so
    the check before the all-to-all is skipped."""
    alignment: int | None = None
    """Rows per expert group are padded to a multiple of this for the grouped GEMM (None: the
    experts module's `group_alignment`, the same on every device; plait.models.moe.kernels says
    where its rule comes from)."""


def validate_expert_parallel(
    num_experts: int, ep: int, tp: int = 1, etp: int = 1, config: ExpertParallelConfig | None = None
) -> None:
    """Local checks, the same on every rank: call before any collective."""
    if config is not None and config.capacity_factor < 0:
        raise ParallelConfigError(
            f"parallelism.expert_capacity_factor = {config.capacity_factor}: use 0 (dropless) or a factor > 0."
        )
    if config is not None and config.capacity_rows is not None and config.capacity_rows < 1:
        raise ParallelConfigError(f"ExpertParallelConfig.capacity_rows = {config.capacity_rows}: use None or rows >= 1.")
    if ep > 1 and num_experts % ep:
        raise ParallelConfigError(
            f"parallelism.ep = {ep} does not divide the {num_experts} routed experts: pick an ep that divides them."
        )
    if etp not in (1, tp):
        raise ParallelConfigError(
            f"parallelism.etp = {etp}: expert tensor parallel is 1 (experts whole, tokens split over the TP "
            f"ranks) or equal to parallelism.tp = {tp} (experts' hidden dim split like the dense FFN)."
        )


def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh, ep_etp_mesh: DeviceMesh | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            # Tensor parallel split the hidden dim (etp = tp): keep this rank's ep slice of its TP
            # shard and describe it on the (ep, etp) mesh.
            if ep_etp_mesh is None or len(param.placements) != 1 or not isinstance(param.placements[0], Shard):
                raise ParallelConfigError(
                    f"routed expert weight {name!r} is already a {param.placements} DTensor: with tensor parallel "
                    "on the experts (experts_tp) expert parallel needs parallelism.etp = tp."
                )
            ep_rank = ep_etp_mesh.get_local_rank(0)
            local = param.to_local().chunk(ep_etp_mesh.size(0), dim=0)[ep_rank].contiguous()
            placements = (Shard(0), param.placements[0])
            sharded = DTensor.from_local(local, ep_etp_mesh, placements, run_check=False)
        else:
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)])
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _experts_module(model: nn.Module, path: str) -> nn.Module:
    """The module at `path`, if it keeps the experts contract (docs/contracts.md, "Your own model:
    expert parallel"); else a one-line error naming what it lacks. Local: no collective."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ParallelConfigError(
            f"expert module {path!r} is not a module path of the model: name the module whose forward takes "
            "(routed_input_ND, num_tokens_per_expert_E)."
        ) from None
    what = f"expert module {path!r} ({type(module).__name__})"
    nested = [name for name, _ in module.named_parameters() if "." in name]
    own = dict(module.named_parameters(recurse=False))
    if nested or not own:
        names = ", ".join(nested[:3]) + (", ..." if len(nested) > 3 else "")
        held = f"{'no parameters of its own' if not own else 'parameters'} in sub-modules ({names})"
        raise ParallelConfigError(
            f"{what} holds {held if nested else 'no parameters'}: expert parallel shards only the weights a module "
            "holds itself, stacked [E, ...]; wrap per-expert modules in plait.expertparallel.StackedExperts(...)."
        )
    first, num_experts = next(iter(own)), next(iter(own.values())).shape[0]
    for name, p in own.items():
        if p.dim() == 0 or p.shape[0] != num_experts:
            raise ParallelConfigError(
                f"{what}: parameter {name!r} has shape {list(p.shape)}, not the experts on dim 0 ({num_experts} from "
                f"{first!r}): stack every expert weight [E, ...]."
            )
    for helper in ("permute_and_pad", "unpermute"):
        if not callable(getattr(module, helper, None)):
            raise ParallelConfigError(
                f"{what} has no {helper}: set {helper} = staticmethod(plait.expertparallel.{helper}) "
                "(the experts contract, docs/contracts.md)."
            )
    try:
        inspect.signature(module.forward).bind(None, None)
    except TypeError:
        raise ParallelConfigError(
            f"{what}: forward{inspect.signature(module.forward)} does not take (routed_input_ND, "
            "num_tokens_per_expert_E) positionally, which expert parallel dispatches."
        ) from None
    return module


def _takes_group_rows(module: nn.Module) -> bool:
    """Whether the experts' forward takes `group_rows` (the optional part of the experts contract:
    every expert owns that many rows, statically, so it may run one batched matmul)."""
    return "group_rows" in inspect.signature(module.forward).parameters


class _DispatchHooks:
    """Forward pre-hook: dispatch the module's inputs. Forward hook: combine its output.

    With `split` (rank, parts) the rows are divided among the TP ranks that hold them all: each
    dispatches only its share and pads the combined rows back (token_split.py)."""

    def __init__(
        self,
        dispatcher: AllToAllDispatcher | CapacityDispatcher,
        split: tuple[int, int] | None = None,
        pass_group_rows: bool = False,
        deferred: bool = False,
    ):
        self.dispatcher = dispatcher
        self.split = split
        self.pass_group_rows = pass_group_rows
        self.deferred = deferred
        self._shares: list[RowShare] = []

    def before(self, module, args, kwargs):
        if len(args) != 2:
            raise TypeError(
                f"{type(module).__name__} called with {len(args)} positional arguments: expert parallel dispatches "
                "experts(routed_input_ND, num_tokens_per_expert_E), both positional."
            )
        x_ND, num_tokens_per_expert_E = args
        if self.split is None:
            x_padded, m_sizes = self.dispatcher.dispatch(x_ND, num_tokens_per_expert_E)
        else:
            rank, parts = self.split
            share = row_share(x_ND.shape[0], rank, parts)
            self._shares.append(share)
            # Capacity blocks must be the same size on every ep rank: size them by the largest share.
            capacity_rows = -(-(getattr(self.dispatcher, "capacity_rows", None) or x_ND.shape[0]) // parts)
            x_padded, m_sizes = self.dispatcher.dispatch(
                take_share(x_ND, share), counts_in_share(num_tokens_per_expert_E, share), capacity_rows=capacity_rows
            )
        if self.pass_group_rows:
            # Capacity mode: every local expert owns ep x capacity rows, a static shape.
            kwargs = {**kwargs, "group_rows": x_padded.shape[0] // self.dispatcher.num_local_experts}
        return (x_padded, m_sizes), kwargs

    def after(self, module, args, y_padded_PD):
        # Data parallel on the experts themselves (expert FSDP, replicate) unshards them before
        # their backward from a hook on this output: it must carry autograd history now.
        y_ND = self.dispatcher.combine(y_padded_PD, deferred=self.deferred and not isinstance(module, FSDPModule))
        return y_ND if self.split is None else restore_share(y_ND, self._shares.pop())

    def link(self, module, args, output):
        self.dispatcher.link_deferred()

    def check_linked(self, module, args, output):
        if self.dispatcher.drop_deferred():
            raise RuntimeError(
                f"expert parallel: {type(module).__name__} returned before the module named to overlap the "
                "combine ran (overlap_modules): that module must run after the experts and before their output "
                "is first used. Fix the forward or drop the module from overlap_modules."
            )


def _overlap_module(model: nn.Module, experts_path: str, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ParallelConfigError(
            f"overlap module {path!r} (for {experts_path!r}) is not a module path of the model: name the module "
            "that runs after the experts and before their output is first used (e.g. the shared experts)."
        ) from None


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    expert_modules: Sequence[str],
    config: ExpertParallelConfig | None = None,
    *,
    tp_mesh: DeviceMesh | None = None,
    ep_etp_mesh: DeviceMesh | None = None,
    overlap_modules: Mapping[str, str] | None = None,
) -> dict[str, AllToAllDispatcher | CapacityDispatcher]:
    """Shard each routed-experts module (`parallel_info()["experts"]`: weights [E, in, out],
    `forward(routed_input_ND, num_tokens_per_expert_E)`, `permute_and_pad` / `unpermute` helpers)
    over `ep_mesh` on dim 0, and move its tokens with all-to-all. Returns the dispatcher of each
    module (their `host_syncs` counters).

    Under tensor parallel pass `tp_mesh` (the experts sit in a TP region). With etp = 1 (the
    experts left whole by TP) each TP rank dispatches its share of the rows; with etp = tp (TP
    already split their hidden dim) pass `ep_etp_mesh`, the 2-D (ep, etp) mesh they end up on.

    `overlap_modules` (`parallel_info()["expert_overlap"]`): experts path -> a module the MoE runs
    after the experts call and before it first uses their output (the shared experts). The
    combine (dropless and capacity) is then linked to autograd when that module has run, so its reverse
    all-to-all overlaps that module's backward as its forward all-to-all overlaps its forward.
    Same values and gradients; skipped under TP row shares (etp = 1), torch.compile, and for
    experts that data parallel wraps themselves (expert FSDP, replicate)."""
    config = config or ExpertParallelConfig()
    overlap_modules = dict(overlap_modules or {})
    ep = ep_mesh.size()
    tp = tp_mesh.size() if tp_mesh is not None else 1
    etp = ep_etp_mesh.size(1) if ep_etp_mesh is not None else 1
    split = (tp_mesh.get_local_rank(), tp) if tp > 1 and etp == 1 else None
    # Every module checked before the first one is sharded (distribute_tensor is a collective).
    modules = {path: _experts_module(model, path) for path in expert_modules}
    overlaps = {path: _overlap_module(model, path, overlap_modules[path]) for path in modules if path in overlap_modules}
    for module in modules.values():
        validate_expert_parallel(next(module.parameters()).shape[0], ep, tp, etp, config)
    dispatchers = {}
    for path, module in modules.items():
        num_experts = next(module.parameters()).shape[0]
        _shard_experts(module, ep_mesh, ep_etp_mesh)
        dispatchers[path] = _attach_dispatcher(model, path, module, num_experts, ep_mesh, config, split,
                                               overlaps.get(path))
    return dispatchers


def _attach_dispatcher(model: nn.Module, path: str, module: nn.Module, num_experts: int, ep_mesh: DeviceMesh,
                       config: ExpertParallelConfig, split, overlap: nn.Module | None):
    """The dispatcher of one sharded experts module (`num_experts`: all ranks'), hooked around its forward."""
    # One padding rule on every path and device: the module's (CPU tensors are CUDA's tensors).
    alignment = config.alignment or getattr(module, "group_alignment", 1)
    if config.capacity_factor > 0:
        dispatcher = CapacityDispatcher(
            ep_mesh.get_group(), num_experts, config.capacity_factor, alignment, config.capacity_rows,
            check_rows=not config.rows_equal_by_construction, device=ep_mesh.device_type,
        )
    else:
        dispatcher = AllToAllDispatcher(
            ep_mesh.get_group(), num_experts, module.permute_and_pad, module.unpermute, alignment
        )
    if hasattr(module, "pad_groups"):
        module.pad_groups = False  # the dispatcher hands it aligned groups
    deferred = overlap is not None and split is None
    hooks = _DispatchHooks(dispatcher, split, config.capacity_factor > 0 and _takes_group_rows(module), deferred)
    module.register_forward_pre_hook(hooks.before, with_kwargs=True)
    module.register_forward_hook(hooks.after)
    module.dispatched_by_expert_parallel = True  # its dispatch pads the groups (TransformersExperts asks)
    if deferred:
        overlap.register_forward_hook(hooks.link)
        parent = path.rpartition(".")[0]
        model.get_submodule(parent).register_forward_hook(hooks.check_linked)
    return dispatcher


__all__ = ["ExpertParallelConfig", "apply_expert_parallel", "validate_expert_parallel"]
