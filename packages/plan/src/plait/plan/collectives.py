"""Count every collective a rank issues, by mesh axis and kind: bytes and calls.

One TorchDispatchMode sees them all at the aten level: FSDP2's and DTensor's (c10d ops issued by
the process group, functional collectives) and the ones plait calls itself (`dist.all_reduce`,
expert-parallel all-to-all). It lets tensor subclasses (DTensor) run first, so it sees the local
tensors that actually travel. The same counter runs in a real run and under the planner's fake
process group, so the two are compared byte for byte.

Bytes are the size of the collective's whole buffer on this rank, whatever the algorithm moves
over the wire: all-gather the gathered output, reduce-scatter the unreduced input, all-reduce and
broadcast the tensor, all-to-all the input this rank sends (its own share included), send/recv
the tensor. `wire_factor` turns that into bytes on the wire for a ring of n ranks.
"""

from collections import defaultdict

import torch
from torch.distributed._tools.fake_collectives import CollectiveOp
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from plait.dataparallel.cpu_overlap import issuing_reduce_scatter

c10d = torch.ops.c10d
fc = torch.ops._c10d_functional
fca = torch.ops._c10d_functional_autograd

# op -> (kind, how to read its bytes: "argN" sums tensors of args[N], "out" the result,
# "argN_x_size" args[N] times the group size)
_OPS = {
    c10d.allgather_.default: ("all_gather", "arg0"),
    c10d._allgather_base_.default: ("all_gather", "arg0"),
    fc.all_gather_into_tensor.default: ("all_gather", "out"),
    fca.all_gather_into_tensor.default: ("all_gather", "out"),
    fc.all_gather_into_tensor_out.default: ("all_gather", "out"),
    fc.all_gather_into_tensor_coalesced.default: ("all_gather", "out"),
    c10d.reduce_scatter_.default: ("reduce_scatter", "arg1"),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", "arg1"),
    fc.reduce_scatter_tensor.default: ("reduce_scatter", "arg0"),
    fca.reduce_scatter_tensor.default: ("reduce_scatter", "arg0"),
    fc.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", "arg0"),
    c10d.allreduce_.default: ("all_reduce", "arg0"),
    fc.all_reduce.default: ("all_reduce", "arg0"),
    fc.all_reduce_.default: ("all_reduce", "arg0"),
    fc.all_reduce_coalesced.default: ("all_reduce", "arg0"),
    fc.all_reduce_coalesced_.default: ("all_reduce", "arg0"),
    c10d.alltoall_.default: ("all_to_all", "arg1"),
    c10d.alltoall_base_.default: ("all_to_all", "arg1"),
    fc.all_to_all_single.default: ("all_to_all", "arg0"),
    fca.all_to_all_single.default: ("all_to_all", "arg0"),
    torch.ops._dtensor.shard_dim_alltoall.default: ("all_to_all", "arg0"),
    c10d.broadcast_.default: ("broadcast", "arg0"),
    fc.broadcast.default: ("broadcast", "arg0"),
    fc.broadcast_.default: ("broadcast", "arg0"),
    c10d.send.default: ("send_recv", "arg0"),
    c10d.recv_.default: ("send_recv", "arg0"),
    c10d.recv_any_source_.default: ("send_recv", "arg0"),
    c10d.gather_.default: ("gather", "arg1"),
    c10d.scatter_.default: ("scatter", "arg1"),
    c10d.reduce_.default: ("reduce", "arg0"),
}

# The axes a process group is named after; several share one group when the others are size 1
# (ep borrowed whole from dp_shard: "dp_shard=ep"). The derived views name a group only when no
# axis does.
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "efsdp", "ep", "etp")
DERIVED = ("dp_shard_cp", "dp_cp", "dp", "world")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def axis_names(meshes) -> dict[str, str]:
    """Process-group name -> mesh axis name, for every 1-D view of `meshes` (plait.mesh.Meshes)."""
    groups: dict[str, list[str]] = {}
    for axis in AXES + DERIVED:
        mesh = getattr(meshes, axis, None) if meshes is not None else None
        if mesh is None or mesh.ndim != 1:
            continue
        names = groups.setdefault(mesh.get_group().group_name, [])
        if axis in AXES or not names:
            names.append(axis)
    return {group: "=".join(names) for group, names in groups.items()}


def wire_factor(kind: str, n: int) -> float:
    """Bytes a ring algorithm puts on the wire per byte of `kind`'s buffer, for n ranks."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


class CollectiveCounter(TorchDispatchMode):
    """`with CollectiveCounter(axis_names(meshes)) as c:` -> c.counts[(phase, axis, kind)] =
    [bytes, calls, group size, rank span]. `phase` is whatever `c.phase` was set to when the collective ran."""

    def __init__(self, group_axes: dict[str, str]):
        super().__init__()
        self.group_axes = group_axes
        self.phase = "step"
        self.counts: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._spans: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor issue its collectives on local tensors first
        out = func(*args, **(kwargs or {}))
        entry = _OPS.get(func)
        if entry is not None:
            kind, where = entry
            if kind == "all_to_all" and issuing_reduce_scatter():
                # FSDP's reduce-scatter on gloo, which has none: the same input bytes, counted as
                # what it is (and what a plan under the fake backend, or NCCL, issues).
                kind = "reduce_scatter"
            group = CollectiveOp.get_process_group(func, args)
            size = _nbytes(out if where == "out" else args[int(where[3])])
            if func is fc.all_gather_into_tensor_out.default:
                size = _nbytes((kwargs or {}).get("out", out))
            axis = self.group_axes.get(group.group_name, f"group:{group.group_name}")
            row = self.counts[(self.phase, axis, kind)]
            row[0] += size
            row[1] += 1
            row[2] = group.size()
            row[3] = self._span(group)
        return out

    def _span(self, group) -> int:
        """How many consecutive global ranks the group covers (1 + last - first)."""
        if group.group_name not in self._spans:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group)
            self._spans[group.group_name] = max(ranks) - min(ranks) + 1
        return self._spans[group.group_name]

    def totals(self, repeat: dict[str, int] | None = None) -> dict[tuple[str, str], dict]:
        """(axis, kind) -> {bytes, count, ranks, span}, each phase's counts times repeat[phase] (default 1)."""
        repeat = repeat or {}
        result: dict[tuple[str, str], dict] = {}
        for (phase, axis, kind), (size, calls, ranks, span) in self.counts.items():
            r = repeat.get(phase, 1)
            row = result.setdefault((axis, kind), {"bytes": 0, "count": 0, "ranks": ranks, "span": span})
            row["bytes"] += size * r
            row["count"] += calls * r
        return dict(sorted(result.items()))
