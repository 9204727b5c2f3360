"""One world DeviceMesh, built once, and the named views every parallelism reads.

Two layouts of the same world are unflattened from one root so all views share it (FSDP + TP/EP
glue needs that):

    dense:  (pp, dp_replicate, dp_shard, cp, tp)     -- attention, dense FFN, embeddings
    sparse: (pp, dp_replicate, efsdp, ep, etp)       -- routed experts (dp2ep), only when ep > 1

Pipeline parallel is the outermost axis: every view but `pp` is over the ranks of one stage (the
same groups a pp = 1 run of stage_world_size ranks would make, offset by the stage). Axes of size
1 are left out, so a view made only of size-1 axes is `None` and a 1-rank run
creates no process group at all.
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .parallel_dims import ParallelDims


# torch 2.13 keeps mesh flatten/unflatten private; this module is the only place that calls them.
def _unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    return mesh._unflatten(0, sizes, names)


def _flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    return mesh._flatten(name)


def _concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    return DeviceMesh._concatenate(meshes)


def _view(layout: DeviceMesh | None, axes: tuple[str, ...], name: str) -> DeviceMesh | None:
    """The view over `axes` of `layout`, flattened to one axis called `name`; None if all are size 1."""
    if layout is None:
        return None
    present = tuple(a for a in axes if a in layout.mesh_dim_names)
    if not present:
        return None
    if len(present) == 1:
        return layout[present[0]]
    return _flatten(layout[present], name)


@dataclass
class Meshes:
    """Named views of the world mesh. A view is None when its size is 1."""

    dims: ParallelDims
    device_type: str
    world: DeviceMesh | None = None
    pp: DeviceMesh | None = None  # the ranks holding the same part of every stage, one per stage
    dense: DeviceMesh | None = None
    sparse: DeviceMesh | None = None
    dp: DeviceMesh | None = None  # dp_replicate x dp_shard: ranks that load different data
    dp_replicate: DeviceMesh | None = None
    dp_shard: DeviceMesh | None = None
    dp_shard_cp: DeviceMesh | None = None  # what FSDP shards non-expert parameters over
    dp_cp: DeviceMesh | None = None  # what the loss is averaged over
    cp: DeviceMesh | None = None
    tp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    etp: DeviceMesh | None = None
    ep_etp: DeviceMesh | None = None  # 2D (ep, etp) when etp > 1: routed experts' (Shard(0), Shard(hidden))
    efsdp: DeviceMesh | None = None  # what FSDP shards routed experts over

    @property
    def fsdp(self) -> DeviceMesh | None:
        """The data-parallel mesh for non-expert parameters: 2D (replicate, shard) under HSDP."""
        return _pair(self.dp_replicate, self.dp_shard_cp)

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """The data-parallel mesh for routed experts: 2D (replicate, efsdp) under HSDP."""
        return _pair(self.dp_replicate, self.efsdp)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that load different data."""
        return self.dp.get_local_rank() if self.dp is not None else 0

    @property
    def dp_degree(self) -> int:
        return self.dims.dp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank (which stage(s) it holds)."""
        return self.pp.get_local_rank() if self.pp is not None else 0

    @property
    def pp_degree(self) -> int:
        return self.dims.pp


def _pair(replicate: DeviceMesh | None, shard: DeviceMesh | None) -> DeviceMesh | None:
    if replicate is not None and shard is not None:
        return _concatenate([replicate, shard])
    return shard if shard is not None else replicate


def build_meshes(dims: ParallelDims, device_type: str = "cpu") -> Meshes:
    """Build every view at start-up: creating a process group is collective, so all ranks take part.

    Call after `init_distributed()`; with world size 1 no process group is needed.
    """
    meshes = Meshes(dims=dims, device_type=device_type)
    if dims.world_size == 1:
        return meshes
    if not dist.is_initialized():
        raise RuntimeError("build_meshes needs a process group: call plait.mesh.init_distributed() first.")
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(
            f"ParallelDims.world_size = {dims.world_size} but the process group has {dist.get_world_size()} ranks."
        )
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    meshes.world = world
    meshes.dense = _layout(
        world,
        (("pp", dims.pp), ("dp_replicate", dims.dp_replicate), ("dp_shard", dims.dp_shard), ("cp", dims.cp),
         ("tp", dims.tp)),
    )
    d = meshes.dense
    meshes.pp = _view(d, ("pp",), "pp")
    meshes.dp_replicate = _view(d, ("dp_replicate",), "dp_replicate")
    meshes.dp_shard = _view(d, ("dp_shard",), "dp_shard")
    meshes.cp = _view(d, ("cp",), "cp")
    meshes.tp = _view(d, ("tp",), "tp")
    meshes.dp = _view(d, ("dp_replicate", "dp_shard"), "dp")
    meshes.dp_shard_cp = _view(d, ("dp_shard", "cp"), "dp_shard_cp")
    meshes.dp_cp = _view(d, ("dp_replicate", "dp_shard", "cp"), "dp_cp")
    if dims.ep > 1:
        meshes.sparse = _layout(
            world,
            (("pp", dims.pp), ("dp_replicate", dims.dp_replicate), ("efsdp", dims.efsdp), ("ep", dims.ep),
             ("etp", dims.etp)),
        )
        s = meshes.sparse
        meshes.efsdp = _view(s, ("efsdp",), "efsdp")
        meshes.ep = _view(s, ("ep",), "ep")
        meshes.etp = _view(s, ("etp",), "etp")
        if dims.etp > 1:
            meshes.ep_etp = s["ep", "etp"]
    return meshes


def _layout(world: DeviceMesh, axes: tuple[tuple[str, int], ...]) -> DeviceMesh | None:
    kept = [(name, size) for name, size in axes if size > 1]
    if not kept:
        return None
    names, sizes = zip(*kept)
    return _unflatten(world, tuple(sizes), tuple(names))
