"""Overlap FSDP's collectives with compute on CPU (gloo), where there are no streams to do it.

FSDP2 overlaps communication on an accelerator by issuing each collective synchronously on a side
stream: the host returns at once and the device orders the work. On CPU a "synchronous" gloo
collective blocks the training thread until it is done, so every all-gather and reduce-scatter is
exposed, prefetched or not. Two changes give the CPU what the streams give the GPU:

- all-gathers are issued with `async_op=True` (torch's switch for it), so an explicitly prefetched
  all-gather runs on gloo's thread while the current block computes and is waited on only where
  its block needs it;
- a reduce-scatter whose output FSDP only views until backward ends (the common case: fp32
  gradients reduced in fp32 with AVG, 1D mesh, no accumulation, no offload) is issued async and
  waited on at the next reduce-scatter (one in flight, as FSDP's one reduce-scatter input buffer on
  GPU) or at the end of backward. Anything else reads the output at once and stays synchronous.

Gloo has no reduce-scatter of its own: torch runs one as an all-reduce of a clone of the whole
input (cloned on the calling thread), then keeps this rank's chunk. On gloo every reduce-scatter
here (deferred or not) instead sends each rank its chunk (`all_to_all_single`: the bytes a
reduce-scatter moves, half an all-reduce's) and sums the received chunks in rank order when it is
waited on: 1.3-2x faster at 1-16 MiB on 2 ranks, and no clone. At 2 ranks the sum is the same
two-term addition gloo does, so the gradients are bit for bit the same (a test compares it with
gloo's reduce-scatter); at more ranks only the order of the terms differs. Which collectives run,
on which inputs and in which order is otherwise unchanged.
"""

import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule

# Not re-exported by torch.distributed.fsdp; set_custom_reduce_scatter (public) takes one.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class _InFlight:
    """Reduce-scatters issued async and not yet waited on, shared by every unit of one model."""

    def __init__(self) -> None:
        self.pending: list[AllToAllReduceScatter | _NativeReduceScatter] = []
        self.callback_task: int | None = None
        self.issued = {"deferred": 0, "synchronous": 0}  # for tests and benchmarks

    def wait(self) -> None:
        while self.pending:
            self.pending.pop(0).finish()

    def add(self, issued: "AllToAllReduceScatter | _NativeReduceScatter") -> None:
        self.pending.append(issued)
        task = torch._C._current_graph_task_id()
        if self.callback_task != task:
            # Once per backward pass: wait for the last reduce-scatters before anything (clipping,
            # the optimizer) reads the gradients. Queued after FSDP's own end-of-backward
            # callback, so it also covers the reduce-scatters that one issues.
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_task = task

    def _end_of_backward(self) -> None:
        self.wait()
        self.callback_task = None


_issuing = threading.local()


def issuing_reduce_scatter() -> bool:
    """True while an `AllToAllReduceScatter` issues its all-to-all, so that a collective counter
    (plait-plan's) counts it as the reduce-scatter it stands for, as on a backend that has one."""
    return getattr(_issuing, "active", False)


class AllToAllReduceScatter:
    """A reduce-scatter (SUM or AVG) as an all-to-all of chunks, issued at construction: every
    rank's chunk for this rank arrives in `received` ([ranks, chunk]); `finish` waits and sums them
    in rank order into `output`."""

    OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)

    def __init__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op) -> None:
        # The input stays referenced until gloo has sent it.
        self.output, self.input, self.op = output_tensor, input_tensor, op
        self.ranks = dist.get_world_size(group)
        self.received = torch.empty_like(input_tensor)
        _issuing.active = True
        try:
            self.work = dist.all_to_all_single(self.received, input_tensor, group=group, async_op=True)
        finally:
            _issuing.active = False

    def finish(self) -> None:
        self.work.wait()
        torch.sum(self.received.view(self.ranks, -1), dim=0, out=self.output.view(-1))
        if self.op == dist.ReduceOp.AVG:
            self.output.div_(self.ranks)


class _NativeReduceScatter:
    """The backend's own reduce-scatter, async (a backend that has one, e.g. plait-plan's fake)."""

    def __init__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op) -> None:
        self.input, self.output = input_tensor, output_tensor  # referenced until the backend is done
        self.work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=True
        )

    def finish(self) -> None:
        self.work.wait()


def _reduce_scatter(output_tensor, input_tensor, group, op) -> "AllToAllReduceScatter | _NativeReduceScatter":
    """Issue a reduce-scatter: on gloo (which has none of its own) as an all-to-all of chunks."""
    if op in AllToAllReduceScatter.OPS and dist.get_backend(group) == "gloo":
        return AllToAllReduceScatter(output_tensor, input_tensor, group, op)
    return _NativeReduceScatter(output_tensor, input_tensor, group, op)


class DeferredReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter for one unit, issued async when nothing reads its output before the
    end of backward (see the module docstring); synchronous otherwise."""

    def __init__(self, unit: FSDPModule, in_flight: _InFlight) -> None:
        self.unit, self.in_flight = unit, in_flight

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        # Every earlier reduce-scatter is waited on first: one in flight bounds the memory held.
        self.in_flight.wait()
        if not self._output_only_viewed(output_tensor, op):
            self.in_flight.issued["synchronous"] += 1
            _reduce_scatter(output_tensor, input_tensor, group, op).finish()
            return None
        self.in_flight.issued["deferred"] += 1
        self.in_flight.add(_reduce_scatter(output_tensor, input_tensor, group, op))
        return None

    def _output_only_viewed(self, output_tensor: torch.Tensor, op) -> bool:
        """FSDP's foreach_reduce after the reduce-scatter: a post-divide (any op but AVG), a cast
        (output dtype != parameter dtype), `grad +=` (a gradient already there), a post-accumulate
        hook or an offload copy would read the output; without them it only views it."""
        if op != dist.ReduceOp.AVG or torch._C._current_graph_task_id() == -1:
            return False
        state = self.unit._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                if (
                    param.dtype != output_tensor.dtype
                    or param.grad is not None
                    or fsdp_param.offload_to_cpu
                    or getattr(param, "_post_accumulate_grad_hooks", None)
                ):
                    return False
        return True


def overlap_on_cpu(root: nn.Module, units: list[FSDPModule]) -> None:
    """Issue `root`'s all-gathers async and give `units` (FSDP, 1D mesh, no custom gradient divide
    factor) the deferred reduce-scatter. CPU only: on an accelerator the streams do this."""
    root._set_unshard_async_op(True)
    in_flight = _InFlight()
    for unit in units:
        unit.set_custom_reduce_scatter(DeferredReduceScatter(unit, in_flight))


def reduce_scatters_issued(unit: FSDPModule) -> dict[str, int]:
    """{"deferred": n, "synchronous": m} reduce-scatters so far by the units sharing `unit`'s
    overlap (every unit of its model); {} where none was set up (not on CPU, or HSDP)."""
    comm = unit._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    return dict(comm.in_flight.issued) if isinstance(comm, DeferredReduceScatter) else {}
