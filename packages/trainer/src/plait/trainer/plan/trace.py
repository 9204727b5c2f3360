"""One training step of one micro-batch for rank 0 of a layout, traced without real data
(pipeline parallel: one micro-batch per stage this rank holds, plan/pipeline.py).

The trainer's own path runs: the meshes of the full world under a fake process group (torch's
`FakeStore` + backend "fake": every collective returns at once and moves nothing), `parallelize`
(the same tensor / context / expert / data parallel calls as plait-train) with every tensor a
FakeTensor (shapes, dtypes and storages, no memory), then `Trainer.train_step` itself on a
micro-batch of zeros. Around it, torch's MemTracker records memory by kind and the planner's
CollectiveCounter records every collective, and the HostOpCounter every op the step dispatches
(host_ops.py: each is a kernel launch on a GPU). `trace_step` works the same on a real process group
(a measured run), so the two are compared field by field.

plait-plan traces with `gpu=True`: the CPU device takes the GPU's kernel routes (gpu_kernel_routes),
so a plan does not depend on the planning CPU's bf16 units; the measured comparisons keep this
CPU's own routes on both sides. Nothing is built per rank but the fake world's mesh coordinates
(FSDP's parameter chunks are made for rank 0 only: rank_zero_chunks).
"""

import contextlib
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

from plait.models.documents import row_segments

from .collectives import CollectiveCounter, axis_names
from .fake_shims import FakeStepShims
from .host_ops import HostOpCounter, Propagating

MICRO = "micro_batch"  # collectives of one micro-batch's forward + backward (repeat per micro-batch)
STEP = "step"  # once per step: the token count, gradient clipping, the optimizer, MoE bookkeeping
# Ops of a run's first optimizer step, which also creates the optimizer's state: not a step's own
# (steady_optimizer_ops counts the step after it instead).
FIRST_OPTIMIZER_STEP = "first_optimizer_step"


class PeakTracker(MemTracker):
    """MemTracker that also remembers where the peak was reached: the innermost module and
    whether in forward or backward (torch's tracker keeps only per-module peaks), and that skips
    DTensor's shape propagation, which under a fake step reuses the step's own FakeTensorMode
    (torch's tracker would count its placeholders: five times the optimizer state for a fused
    AdamW over DTensor parameters)."""

    def __init__(self):
        super().__init__()
        self.peak_where = ("", "")
        self._propagating = None

    def __enter__(self):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        if self._propagating is None:
            self._propagating = Propagating(ShardingPropagator._fake_mode_lock)
            ShardingPropagator._fake_mode_lock = self._propagating
        return super().__enter__()

    def __exit__(self, *args):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        super().__exit__(*args)
        if self._depth == 0 and self._propagating is not None:
            ShardingPropagator._fake_mode_lock = self._propagating.inner
            self._propagating = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating is not None and self._propagating.depth:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module, inputs) -> None:
        # A pipeline stage is a top-level module called once per micro-batch, which torch's tracker
        # refuses ("multiple iterative calls"); its per-module stats start over instead (only the
        # step's totals are read).
        if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) <= {"Global", self._mod_fqn(module)}:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    def _mod_fqn(self, module) -> str | None:
        return self._mod_tracker.get_known_fqn(module)

    def _update_peak_stats(self, peak_state) -> None:
        # The step's peak only: torch's version also updates every active module's own peak,
        # walking all tracked modules on every op (quadratic in depth: minutes at 61 layers).
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)
                parents = [p for p in self._mod_tracker.parents if p != "Global"]
                innermost = max(parents, key=lambda p: p.count(".")) if parents else "(outside any module: the loss)"
                phase = "backward" if self._mod_tracker.is_bw else ("optimizer" if self._in_opt else "forward")
                self.peak_where = (innermost, phase)


@dataclass
class StepTrace:
    """What one traced (or measured) step of rank 0 did."""

    params: int  # bytes of the parameters this rank holds (local shards)
    grads: int  # bytes of their gradients after the step's backward
    optimizer: int  # bytes of the optimizer state after the step
    activations: int  # bytes alive for backward when the loss is computed (the logits included)
    logits: int  # bytes of the logits this rank computes
    peak: int  # highest memory of the step (MemTracker: parameters + gradients + state + activations + temporaries)
    peak_module: str  # the innermost module running at the peak
    peak_phase: str  # forward, backward or optimizer
    peak_parts: dict = field(default_factory=dict)  # MemTracker's categories at the peak
    collectives: dict = field(default_factory=dict)  # (axis, kind) -> {bytes, count, ranks}, per step
    micro_batch_tokens: int = 0
    host_syncs: int = 0  # expert-parallel dispatch syncs of the step (the dispatchers' own count)
    host_reads: int = 0  # scalars a plan had to assume (balanced routing); 0 for a measured step
    host_ops: int = 0  # ops the step dispatches, each at least one kernel launch on a GPU (host_ops.py)
    host_kernel_ops: int = 0  # of them, those that launch a kernel (views and allocations left out)
    host_ops_by_op: dict = field(default_factory=dict)  # "namespace::op" -> calls per step
    pipeline: dict = field(default_factory=dict)  # pp > 1: schedule, micro-batches in flight, p2p (plan/pipeline.py)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _storage_total(snapshot: dict) -> dict:
    parts: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", str(key))  # "Parameter", "Activation", ... ("Total")
            parts[name] = parts.get(name, 0) + value
    return parts


def trainer_for_step(config, plan, meshes, pm, optimizer, scheduler, device):
    """A Trainer holding just what `train_step` reads (no data loader, checkpointer or lock)."""
    from ..moe_step import MoEStep
    from ..train import Trainer, cross_entropy_loss

    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.plan, trainer.meshes, trainer.device = config, plan, meshes, device
    trainer.pm, trainer.model = pm, pm.model
    trainer.optimizer, trainer.scheduler = optimizer, scheduler
    trainer.moe = MoEStep.for_model(pm.inner, plan.model_args, meshes, pm.dispatchers,
                                    whole_model=plan.model if pm.stages else None)
    trainer.loss_context = trainer._loss_context_factory()
    trainer.loss_fn = cross_entropy_loss
    trainer.pipeline = None  # pp > 1: plan/pipeline.py sets the trainer's pipeline
    return trainer


def micro_batch(config, seq_len: int | None = None, documents_per_row: int = 1):
    """One [local_batch_size, seq_len] micro-batch: token 0 everywhere, `documents_per_row` documents
    of (nearly) equal length per row (the document positions restart at each one's first token).
    Real CPU tensors (make them outside FakeTensorMode)."""
    t = config.training
    seq_len = seq_len or t.seq_len
    if not 1 <= documents_per_row <= seq_len:
        raise ValueError(f"documents_per_row must be in 1..{seq_len}, got {documents_per_row}")
    tokens_BS = torch.zeros(t.local_batch_size, seq_len, dtype=torch.long)
    starts_S = torch.arange(seq_len) * documents_per_row // seq_len  # each token's document
    first_S = torch.searchsorted(starts_S, starts_S)  # where that document starts
    positions_S = (torch.arange(seq_len) - first_S).to(torch.int32)
    documents_BS = positions_S.expand(t.local_batch_size, seq_len).contiguous()
    # Segments read now, on the host, as the trainer does before a step (a fake step cannot read them).
    row_segments(documents_BS)
    return tokens_BS, tokens_BS.clone(), documents_BS


@contextlib.contextmanager
def steady_optimizer_ops(ops: HostOpCounter, optimizer, phase: str = STEP):
    """Count the optimizer step as a step after the first runs it. A first step also creates the
    optimizer's state (AdamW: three tensors per parameter, once per run): its ops go to
    FIRST_OPTIMIZER_STEP, and on leaving, the optimizer steps once more on the same gradients under
    `phase` (state and parameters move again: call it on a step whose results are not kept, as a
    plan or a measured step)."""
    kept, before = [], []

    def pre(opt, args, kwargs):
        if opt.state:
            return  # state made by an earlier step: this one is a steady step already
        kept.extend((p, p.grad) for group in opt.param_groups for p in group["params"] if p.grad is not None)
        before.append(ops.phase)
        ops.phase = FIRST_OPTIMIZER_STEP

    def post(opt, args, kwargs):
        if before:
            ops.phase = before.pop()

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if kept:
        for p, grad in kept:
            p.grad = grad
        # The step itself, without torch's wrapper: its profiler range and hooks ran (and were
        # counted) around the first step already.
        step = getattr(type(optimizer).step, "__wrapped__", None)
        with ops, ops.in_phase(phase):
            step(optimizer) if step is not None else optimizer.step()
        for p, _ in kept:
            p.grad = None


def measure_step(trainer, micro_batches, accumulation: int = 1) -> StepTrace:
    """Run `trainer.train_step(micro_batches)` under the memory tracker, the collective counter and
    the op counter (rank-local; every rank of a real run calls it, rank 0's answer is the one compared).
    `accumulation` > 1 with one micro-batch: the step it stands for runs that many (collectives and
    ops of the micro-batch repeated, the held gradients added to the peak of the later ones)."""
    counter = CollectiveCounter(axis_names(trainer.meshes))
    ops = HostOpCounter(STEP)
    ops.skip.add(FIRST_OPTIMIZER_STEP)
    tracker = PeakTracker()
    inner = trainer.pm.inner
    tracker.track_external(inner, trainer.optimizer)
    seen = {}

    original_context, original_loss = trainer.loss_context, trainer.loss_fn

    @contextlib.contextmanager
    def micro_batch_phase():
        counter.phase = ops.phase = MICRO
        if seen.get("micro_batches"):
            tracker.reset_mod_stats()  # the next micro-batch runs the same modules again
        seen["micro_batches"] = seen.get("micro_batches", 0) + 1
        try:
            with original_context():
                yield
        finally:
            counter.phase = ops.phase = STEP

    def loss_fn(logits_BSV, labels_BS):
        # After the model's forward: what is alive now is kept for backward (the logits included).
        if "activations" not in seen:
            parts = _storage_total(tracker.get_tracker_snapshot("current"))
            seen["activations"] = parts.get("Activation", 0)
            seen["logits"] = _local_bytes([logits_BSV])
        return original_loss(logits_BSV, labels_BS)

    trainer.loss_context, trainer.loss_fn = micro_batch_phase, loss_fn
    grads = {}

    def keep_grads(optimizer, args, kwargs):
        grads["bytes"] = _local_bytes(p.grad for p in inner.parameters())
        grads["peak"] = max(tracker._peak_mem.values(), default=0)  # forward + backward's peak
        grads["where"] = tracker.peak_where

    hook = trainer.optimizer.register_step_pre_hook(keep_grads)
    dispatchers = list((trainer.pm.dispatchers or {}).values())
    syncs_before = sum(getattr(d, "host_syncs", 0) for d in dispatchers)
    try:
        with steady_optimizer_ops(ops, trainer.optimizer):
            with tracker, counter, ops:
                trainer.train_step(micro_batches)
            hook.remove()  # before the optimizer's second step: the first one's gradients are the step's
    finally:
        hook.remove()
        trainer.loss_context, trainer.loss_fn = original_context, original_loss
    peak = tracker.get_tracker_snapshot("peak")
    optimizer_bytes = _local_bytes(v for s in trainer.optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    peak_bytes = max(tracker._peak_mem.values(), default=0)
    where = tracker.peak_where
    if accumulation > 1 and grads:
        # Traced once, run `accumulation` times: from the second micro-batch on, the gradients of
        # the ones before are held through forward and backward.
        later = grads["peak"] + grads["bytes"]
        if later > peak_bytes:
            peak_bytes, where = later, grads["where"]
    t = trainer.config.training
    return StepTrace(
        params=_local_bytes(inner.parameters()),
        grads=grads.get("bytes", 0),
        optimizer=optimizer_bytes,
        activations=seen.get("activations", 0),
        logits=seen.get("logits", 0),
        peak=peak_bytes,
        peak_module=where[0],
        peak_phase=where[1],
        peak_parts={k: v for k, v in _storage_total(peak).items() if k != "Total"},
        collectives={f"{axis}/{kind}": row for (axis, kind), row in counter.totals({MICRO: accumulation}).items()},
        micro_batch_tokens=t.local_batch_size * t.seq_len,
        host_syncs=(sum(getattr(d, "host_syncs", 0) for d in dispatchers) - syncs_before) * accumulation,
        host_ops=ops.ops({MICRO: accumulation}),
        host_kernel_ops=ops.kernel_ops({MICRO: accumulation}),
        host_ops_by_op=dict(ops.by_op({MICRO: accumulation}).most_common()),
    )


class _LazyChunks(Sequence):
    """FSDP's `_chunk_with_empty(tensor, num_chunks, dim)` (torch.chunk, padded with empty tensors
    to num_chunks), each chunk made when it is read. FSDP reads two of them per parameter (this
    rank's and the 0th, which gives the padded size); torch's list makes all num_chunks, which at
    4,096 ranks was 126 of a plan's 128 seconds (the debug model) and grows with the world."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.rows = tensor.size(dim)
        self.chunk_rows = -(-self.rows // num_chunks)  # torch.chunk's split size

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        i = i + self.num_chunks if i < 0 else i
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        start = i * self.chunk_rows
        if start < self.rows:
            return self.tensor.narrow(self.dim, start, min(self.chunk_rows, self.rows - start))
        return self[0].new_empty(0)


@contextlib.contextmanager
def rank_zero_chunks():
    """FSDP's parameter chunks made only where read (_LazyChunks): same shards, no per-rank work."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    eager = _fsdp_param._chunk_with_empty

    def chunk_with_empty(tensor, num_chunks, dim):
        if num_chunks <= 64 or tensor.size(dim) == 0:  # small worlds (and torch's empty-tensor case) as torch does
            return eager(tensor, num_chunks, dim)
        return _LazyChunks(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = eager


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of `world_size` ranks in which this process is rank 0 (FSDP's shards
    made for rank 0 only: rank_zero_chunks)."""
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("plait-plan needs a process without a process group (it makes a fake one).")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        with rank_zero_chunks():
            yield
    finally:
        dist.destroy_process_group()


def build_traced_trainer(config, plan, meshes, device, shims):
    """The trainer's own build (parallelize, optimizer, scheduler) inside the caller's fake world
    and FakeTensorMode, as a Trainer for one step (trainer_for_step)."""
    from ..lr_scheduler import build_lr_scheduler
    from ..optimizer import build_optimizer
    from ..parallelize import parallelize

    # Full or sharded init as the run would; parallelize warns that sharded init on CPU draws
    # equal numbers per shard: true, and irrelevant here.
    shims.initialising = True
    with contextlib.redirect_stdout(io.StringIO()):
        pm = parallelize(config, plan, meshes, device)
    shims.initialising = False
    for dispatcher in (pm.dispatchers or {}).values():
        if hasattr(dispatcher, "ep"):
            shims.balance(dispatcher)
    optimizer = build_optimizer(pm.inner, config.optimizer, device)
    scheduler = build_lr_scheduler(optimizer, config.training.steps, config.lr_scheduler)
    return trainer_for_step(config, plan, meshes, pm, optimizer, scheduler, device)


@contextlib.contextmanager
def gpu_kernel_routes():
    """The CPU device takes a GPU's kernel routes (plait.models.cpu_bf16.gpu_route, and context
    parallel's blocks: plait.contextparallel.kernels.gpu_route): bf16 products and attention in
    bf16, no CPU-only padding, whatever this CPU's bf16 units."""
    from plait.models import cpu_bf16

    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_bf16.gpu_route())
        try:
            from plait.contextparallel import kernels as cp_kernels
        except ImportError:  # context parallel not installed: no layout of this plan uses it
            cp_kernels = None
        if cp_kernels is not None:
            stack.enter_context(cp_kernels.gpu_route())
        yield


def trace_step(config, plan, documents_per_row: int = 1, gpu: bool = False) -> StepTrace:
    """Rank 0's step of the validated `plan` under a fake world of plan.dims.world_size ranks, on
    rows of `documents_per_row` documents each (what a document mask sees; micro_batch). `gpu`:
    through a GPU's kernel routes (gpu_kernel_routes: what plait-plan traces); without it, through
    this CPU's own (what a measured step on this CPU runs)."""
    with gpu_kernel_routes() if gpu else contextlib.nullcontext():
        return _trace_step(config, plan, documents_per_row)


def _forget_cached_tensors() -> None:
    """Tensors a package keeps per process (context parallel's chunk order indices) that an earlier
    trace made: made again by this one, so every plan in a process counts them as the first does."""
    layout = sys.modules.get("plait.contextparallel.layout")
    if layout is not None:
        layout._order_indices.cache_clear()


def _trace_step(config, plan, documents_per_row: int) -> StepTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from plait.mesh import build_meshes

    _forget_cached_tensors()
    device = torch.device("cpu")
    with fake_world(plan.dims.world_size):
        meshes = build_meshes(plan.dims, device.type)  # real mesh tensors, fake groups
        shims = FakeStepShims()
        if plan.dims.pp > 1:
            from .pipeline import trace_pipeline_step

            with FakeTensorMode(allow_non_fake_inputs=True), shims:
                return trace_pipeline_step(config, plan, meshes, device, shims, documents_per_row)
        batch = micro_batch(config, documents_per_row=documents_per_row)
        with FakeTensorMode(allow_non_fake_inputs=True), shims:
            trainer = build_traced_trainer(config, plan, meshes, device, shims)
            traced = measure_step(trainer, [batch], config.training.gradient_accumulation_steps)
    traced.host_reads = shims.reads * config.training.gradient_accumulation_steps
    return traced
