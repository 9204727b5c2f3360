"""One training step of one micro-batch for rank 0 of a layout, traced without real data
(pipeline parallel: one micro-batch per stage this rank holds, plan/pipeline.py).

The trainer's own path runs: the meshes of the full world under a fake process group (torch's
`FakeStore` + backend "fake": every collective returns at once and moves nothing), `parallelize`
(the same tensor / context / expert / data parallel calls as plait-train) with every tensor a
FakeTensor (shapes, dtypes and storages, no memory), then plait-train's own `StepRunner.train_step` on a
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
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .collectives import CollectiveCounter, axis_names
from .fake_shims import FakeStepShims
from .host_ops import HostOpCounter
from .traced_step import (  # noqa: F401  (re-exported: the planner's tests and benchmarks read them here)
    FIRST_OPTIMIZER_STEP,
    MICRO,
    STEP,
    PeakTracker,
    StepTrace,
    _local_bytes,
    _storage_total,
    build_traced_trainer,
    micro_batch,
    optimizer_state_bytes,
    steady_optimizer_ops,
    trainer_for_step,
)


def measure_step(trainer, micro_batches, accumulation: int = 1) -> StepTrace:
    """Run `trainer.train_step(micro_batches)` under the memory tracker, the collective counter and
    the op counter (rank-local; every rank of a real run calls it, rank 0's answer is the one compared).
    `accumulation` > 1 with one micro-batch: the step it stands for runs that many (collectives and
    ops of the micro-batch repeated, the held gradients added to the peak of the later ones)."""
    counter = CollectiveCounter(axis_names(trainer.meshes))
    ops = HostOpCounter(STEP)
    ops.skip.add(FIRST_OPTIMIZER_STEP)
    tracker = PeakTracker()
    tracker.track_external(trainer.pm.inner, trainer.optimizer)
    hooks = _StepHooks(trainer, counter, ops, tracker)
    dispatchers = list((trainer.pm.dispatchers or {}).values())
    syncs_before = sum(getattr(d, "host_syncs", 0) for d in dispatchers)
    try:
        with steady_optimizer_ops(ops, trainer.optimizer):
            with tracker, counter, ops:
                trainer.train_step(micro_batches)
            hooks.grads_hook.remove()  # before the optimizer's second step: the first one's gradients are the step's
    finally:
        hooks.remove()
    peak_bytes, where = _accumulated_peak(tracker, hooks.grads, accumulation)
    t = trainer.config.training
    return StepTrace(
        params=_local_bytes(trainer.pm.inner.parameters()),
        grads=hooks.grads.get("bytes", 0),
        optimizer=optimizer_state_bytes(trainer.optimizer),
        activations=hooks.seen.get("activations", 0),
        logits=hooks.seen.get("logits", 0),
        peak=peak_bytes,
        peak_module=where[0],
        peak_phase=where[1],
        peak_parts={k: v for k, v in _storage_total(tracker.get_tracker_snapshot("peak")).items() if k != "Total"},
        collectives={f"{axis}/{kind}": row for (axis, kind), row in counter.totals({MICRO: accumulation}).items()},
        micro_batch_tokens=t.local_batch_size * t.seq_len,
        host_syncs=(sum(getattr(d, "host_syncs", 0) for d in dispatchers) - syncs_before) * accumulation,
        host_ops=ops.ops({MICRO: accumulation}),
        host_kernel_ops=ops.kernel_ops({MICRO: accumulation}),
        host_ops_by_op=dict(ops.by_op({MICRO: accumulation}).most_common()),
    )


class _StepHooks:
    """The trainer's hooks while measure_step runs its step: each micro-batch in the MICRO phase,
    what is alive when the first one's loss is computed (`seen`), the gradients and the peak when
    the optimizer steps (`grads`). `remove` puts the trainer's own back."""

    def __init__(self, trainer, counter: CollectiveCounter, ops: HostOpCounter, tracker: PeakTracker):
        self.trainer, self.counter, self.ops, self.tracker = trainer, counter, ops, tracker
        self.seen, self.grads = {}, {}
        self.original_context, self.original_loss = trainer.loss_context, trainer.loss_fn
        self.original_host_work = trainer.micro_batch_context
        trainer.loss_context, trainer.loss_fn = self.micro_batch_phase, self.loss_fn
        trainer.micro_batch_context = self.micro_batch_host_work
        self.grads_hook = trainer.optimizer.register_step_pre_hook(self.keep_grads)

    def remove(self) -> None:
        self.grads_hook.remove()
        self.trainer.loss_context, self.trainer.loss_fn = self.original_context, self.original_loss
        self.trainer.micro_batch_context = self.original_host_work

    @contextlib.contextmanager
    def micro_batch_host_work(self):
        """A micro-batch's host work before its forward (its copy to the device, its CP share, MTP
        rows): counted per micro-batch, like the forward and backward."""
        self.counter.phase = self.ops.phase = MICRO
        try:
            yield
        finally:
            self.counter.phase = self.ops.phase = STEP

    @contextlib.contextmanager
    def micro_batch_phase(self):
        self.counter.phase = self.ops.phase = MICRO
        if self.seen.get("micro_batches"):
            self.tracker.reset_mod_stats()  # the next micro-batch runs the same modules again
        self.seen["micro_batches"] = self.seen.get("micro_batches", 0) + 1
        try:
            with self.original_context():
                yield
        finally:
            self.counter.phase = self.ops.phase = STEP

    def loss_fn(self, logits_BSV, labels_BS):
        # After the model's forward: what is alive now is kept for backward (the logits included).
        if "activations" not in self.seen:
            parts = _storage_total(self.tracker.get_tracker_snapshot("current"))
            self.seen["activations"] = parts.get("Activation", 0)
            self.seen["logits"] = 0
        if self.seen.get("micro_batches", 1) == 1:  # the main head's, then each MTP depth's (all alive)
            self.seen["logits"] += _local_bytes([logits_BSV])
        return self.original_loss(logits_BSV, labels_BS)

    def keep_grads(self, optimizer, args, kwargs):
        self.grads["bytes"] = _local_bytes(p.grad for p in self.trainer.pm.inner.parameters())
        self.grads["peak"] = max(self.tracker._peak_mem.values(), default=0)  # forward + backward's peak
        self.grads["where"] = self.tracker.peak_where


def _accumulated_peak(tracker: PeakTracker, grads: dict, accumulation: int) -> tuple[int, tuple[str, str]]:
    """The traced step's peak and where it was reached, for a step of `accumulation` micro-batches."""
    peak_bytes, where = max(tracker._peak_mem.values(), default=0), tracker.peak_where
    if accumulation > 1 and grads:
        # Traced once, run `accumulation` times: from the second micro-batch on, the gradients of
        # the ones before are held through forward and backward.
        later = grads["peak"] + grads["bytes"]
        if later > peak_bytes:
            peak_bytes, where = later, grads["where"]
    return peak_bytes, where


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
