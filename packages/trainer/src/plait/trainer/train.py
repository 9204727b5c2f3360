"""One training run: validate -> process group -> meshes -> model -> optimizer -> data -> resume -> loop.

The loop keeps everything on the device between log steps: losses and gradient norms are
recorded as tensors and flushed every `metrics.log_freq` steps (metrics.py), which is also when
non-finite losses are caught and a SIGTERM is agreed on across ranks. Before every checkpoint the
steps since the last flush are checked too (one all-reduce and one host sync per save), so a
non-finite state is never published and never makes `keep_last` prune a good one.
"""

import contextlib
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.data.prefetch import DataWaitStopped, PrefetchingLoader
from plait.data.sources import DataError
from plait.mesh import build_meshes, destroy_distributed, init_distributed
from plait.models import cpu_bf16

from . import exit_codes, rank_notes
from .checkpoint import CheckpointManager
from .config import Config, ConfigError, to_toml
from .lr_scheduler import build_lr_scheduler
from .metrics import MetricsLogger, peak_tflops
from .moe_step import MoEStep
from .optimizer import build_optimizer
from .parallelize import parallelize
from .pipeline import merge_micro_batches
from .run_lock import CHECKPOINT_LOCK_NAME, HELD_BY_LAUNCHER, RunLock, RunLocks
from .step import IGNORE_INDEX, StepRunner, cross_entropy_loss  # noqa: F401  (cross_entropy_loss: read here)
from .validate import RunPlan, validate


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message names the step and what to try."""


def _set_determinism(config: Config) -> None:
    torch.manual_seed(config.job.seed)
    if config.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


class _StopSignal:
    """SIGTERM sets a flag; the loop finishes its step, writes its metrics, saves (with checkpoints
    enabled) and the run ends unfinished (plait-train exits 75 so schedulers requeue it)."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: call on every rank at the same step)."""
        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def _take_run_lock(config: Config, rank: int) -> RunLocks | None:
    """Rank 0 locks the dump folder (unless the plait launcher holds it for the ranks) and the
    checkpoint folder, and every rank learns the verdict, so all fail with the same line and none
    waits in a collective."""
    locks, verdict = None, None
    if rank == 0:
        locks = RunLocks()
        try:
            if not os.environ.get(HELD_BY_LAUNCHER):
                locks.take(RunLock(config.job.dump_folder))
            c = config.checkpoint
            folder = Path(config.job.dump_folder) / c.folder
            if (c.enable or c.create_seed_checkpoint) and folder.resolve() != Path(config.job.dump_folder).resolve():
                locks.take(RunLock(str(folder), CHECKPOINT_LOCK_NAME, "checkpoint.folder", status=False,
                                   note={"dump_folder": os.path.abspath(config.job.dump_folder)}))
            verdict = ("ok", locks.warnings)
        except ConfigError as e:
            locks.release(exit_codes.CONFIG)
            verdict = ("error", str(e))
    if dist.is_initialized():
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    kind, value = verdict
    if kind == "error":
        raise ConfigError(value)
    for warning in value if rank == 0 else []:
        print(f"plait-train: warning: {warning}", flush=True)
    return locks


def _data_exchange():
    """The ranks that tokenise the data between them: every rank of the job, over a gloo group of
    the data's own (tokens are host data; a prefetch thread must not interleave with training's
    collectives). Collective: every rank calls it at the same point."""
    from plait.data.exchange import DistributedExchange, SoloExchange

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return SoloExchange()
    return DistributedExchange(dist.new_group(backend="gloo"))


def _build_loader(config: Config, plan: RunPlan, meshes, dataset: str, split: str, accumulation: int, exchange):
    from plait.data import build_dataloader

    t = config.training
    try:
        return build_dataloader(
            dataset=dataset,
            dataset_path=(config.data.dataset_path or None) if dataset == config.data.dataset else None,
            tokenizer=plan.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            gradient_accumulation_steps=accumulation,
            dp_rank=meshes.dp_rank,
            dp_degree=meshes.dp_degree,
            seed=config.job.seed,
            split=split,
            streaming=config.data.streaming,
            text_field=config.data.text_field,
            exchange=exchange,
        )
    except (FileNotFoundError, ValueError, KeyError) as e:
        # Every rank fails the same way here, so no rank is left waiting in a collective.
        raise ConfigError(f"data.dataset = {dataset!r} ({split}): {e}") from None


def _profiler(config: Config, rank: int, device: torch.device):
    every = config.metrics.profile_interval
    if not every:
        return contextlib.nullcontext(None)
    folder = os.path.join(config.job.dump_folder, "profile")
    os.makedirs(folder, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_ready(prof):
        prof.export_chrome_trace(os.path.join(folder, f"step{prof.step_num}_rank{rank}.json"))

    # Steps wait ... warmup, then one active step: a trace at steps every, 2*every, ...
    schedule = torch.profiler.schedule(wait=max(0, every - 2), warmup=min(1, every - 1), active=1)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_ready)


class Trainer:
    # Tests set a plait.testing.sentinel.StepSentinel here: entered around each train_step, its counts
    # go into that step's metrics row (host_syncs, precondition_violations; rank 0's, as written).
    step_sentinel = None

    def __init__(self, config: Config):
        self.config = config
        self.plan = validate(config, check_memory=True)  # before any collective
        _set_determinism(config)
        cpu_bf16.set_route(config.training.cpu_bf16)  # the models' CPU kernels; context parallel's follow
        self.dist = init_distributed(timeout_s=config.job.collective_timeout_s)
        self.device = self.dist.device
        self.rank = self.dist.rank
        self.lock = _take_run_lock(config, self.rank)
        try:
            self._build(config)
        except BaseException as e:
            self.release(exit_code_of(e))
            raise

    def release(self, exit_code: int) -> tuple[int, str]:
        """Record the exit code and give the dump folder's lock back (rank 0, when it took it); the
        settled code and why it changed (exit_codes.settle)."""
        if self.lock is not None:
            return self.lock.release(exit_code)
        return exit_code, ""

    def _build(self, config: Config) -> None:
        self.meshes = build_meshes(self.plan.dims, self.device.type)
        self.pm = parallelize(config, self.plan, self.meshes, self.device)
        self.model = self.pm.model
        self.optimizer = build_optimizer(self.pm.inner, config.optimizer, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, config.training.steps, config.lr_scheduler)
        self.loader = _build_loader(
            config, self.plan, self.meshes, config.data.dataset, "train", config.training.gradient_accumulation_steps,
            _data_exchange(),
        )
        if config.data.prefetch:
            self.loader = PrefetchingLoader(self.loader, config.data.prefetch)
        self._validation_exchange = None  # made at the first validation (every rank validates then)
        self.moe = MoEStep.for_model(
            self.pm.inner, self.plan.model_args, self.meshes, self.pm.dispatchers,
            whole_model=self.plan.model if self.pm.stages else None,
        )
        # Under training.compile the loss is compiled too (the fp32 upcast fuses into the
        # log-softmax); not on tensor-parallel (DTensor) logits.
        compile_loss = config.training.compile and self.plan.dims.tp == 1
        self.loss_fn = torch.compile(cross_entropy_loss) if compile_loss else cross_entropy_loss
        self.checkpointer = CheckpointManager(
            config, self.plan.dims, self.pm.inner, self.optimizer, self.scheduler, self.loader, self.rank
        )
        self.pipeline = None
        if self.pm.stages:
            from .pipeline import build_trainer_pipeline

            self.pipeline = build_trainer_pipeline(
                config, self.plan, self.meshes, self.pm, self.loss_fn, self.moe, self.device
            )
        self.runner = StepRunner(config, self.plan, self.meshes, self.pm, self.optimizer, self.scheduler, self.device,
                                 moe=self.moe, loss_fn=self.loss_fn, pipeline=self.pipeline)  # fmt: skip
        self.step = self.checkpointer.load()  # the last completed step: 0, or a resumed checkpoint's

    # ---- one step (step.py) -----------------------------------------------------------------

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.train_step(micro_batches)

    def _read_documents(self, micro_batches) -> None:
        self.runner.read_documents(micro_batches)

    @torch.no_grad()
    def validate_loss(self) -> float:
        # Eval mode: MoE routers do not count these tokens into the load-balance update, and nothing
        # else a training forward records (aux losses) is touched.
        self.model.eval()
        try:
            return self._validation_loss()
        finally:
            self.model.train()

    def _validation_loss(self) -> float:
        c = self.config
        if self._validation_exchange is None:
            self._validation_exchange = _data_exchange()
        # Under pipeline parallel a validation batch is as large as a training step's local batch
        # (the schedule's micro-batch count is fixed): the accumulation's batches, merged.
        accumulation = c.training.gradient_accumulation_steps if self.pipeline is not None else 1
        loader = _build_loader(c, self.plan, self.meshes, c.data.val_dataset, "validation", accumulation,
                               self._validation_exchange)
        # [loss sum, valid tokens] over every batch and every dp x cp rank: the token-weighted mean.
        totals = torch.zeros(2, device=self.device)
        autocast = self.pm.autocast or contextlib.nullcontext()
        n = 0
        for micro_batches in loader:
            if self.pipeline is not None:
                micro_batches = merge_micro_batches(micro_batches)
            self._read_documents(micro_batches)
            for micro_batch in micro_batches:
                inputs_BS, labels_BS, positions, documents_BS = self.runner.local_batch(*micro_batch)
                with self.runner.loss_context(), autocast:
                    if self.pipeline is not None:  # the loss sum on the last stage's rank, else None
                        loss = self.pipeline.eval_step(
                            inputs_BS, labels_BS, positions=positions, document_positions=documents_BS
                        )
                        loss = torch.zeros((), device=self.device) if loss is None else loss
                    else:
                        loss = cross_entropy_loss(self.runner.forward(inputs_BS, positions, documents_BS), labels_BS)
                totals[0] += loss.full_tensor() if isinstance(loss, DTensor) else loss
                totals[1] += (labels_BS != IGNORE_INDEX).sum()
                n += 1
            if n >= c.data.val_steps:
                break
        if self.pipeline is not None:  # the loss sums live on the last stage's ranks
            loss_sum = totals[0].clone()
            dist.all_reduce(loss_sum, group=self.meshes.pp.get_group())
            totals[0] = loss_sum
        if self.meshes.dp_cp is not None:
            dist.all_reduce(totals, group=self.meshes.dp_cp.get_group())
        return (totals[0] / totals[1].clamp(min=1)).item()

    # ---- the loop ---------------------------------------------------------------------------

    def _metrics(self) -> MetricsLogger:
        c = self.config
        t = c.training
        dtype = torch.bfloat16 if t.dtype == "bfloat16" else torch.float32
        # Under tp/cp a rank's share of each sequence is 1/(tp*cp): per-rank throughput counts that
        # share (as FLOPs do), and global throughput = per rank x world size = tokens of the global batch.
        # Under pp each rank runs its stages (1/pp of the model) on the local batch: a 1/pp share too.
        share = self.plan.dims.tp * self.plan.dims.cp * self.plan.dims.pp
        tokens_per_rank = t.local_batch_size * t.gradient_accumulation_steps * t.seq_len / share
        return MetricsLogger(
            dump_folder=c.job.dump_folder,
            rank=self.rank,
            world_size=self.plan.dims.world_size,
            device=self.device,
            loss_mesh=self.meshes.dp_cp,
            tokens_per_step_per_rank=tokens_per_rank,
            flops_per_token=self.pm.inner.flops_per_token(t.seq_len),
            peak_tflops_per_rank=peak_tflops(self.device, dtype, c.metrics.cpu_peak_tflops),
            tensorboard=c.metrics.tensorboard,
            total_steps=t.steps,
            progress_bar=c.metrics.progress_bar,
            start_step=self.step,
            wandb_config=c if c.metrics.wandb else None,
        )

    def _check_finite(self, rows: list[dict]) -> None:
        for row in rows:
            for key in ("loss", "grad_norm"):
                value = row[key]
                if value != value or value in (float("inf"), float("-inf")):
                    raise TrainingDiverged(
                        f"{key} is {value} at step {row['step']}: the run diverged. Try a lower optimizer.lr, "
                        "more lr_scheduler.warmup_steps, a smaller training.max_norm, or training.dtype = float32."
                    )

    def _check_finite_before_save(self, metrics: MetricsLogger) -> None:
        """Raise TrainingDiverged if any step since the last flush was non-finite on any rank."""
        if not metrics.window_finite():
            self._check_finite(metrics.flush())  # the rows name the first bad step

    def train(self) -> bool:
        """Train to training.steps; return whether the run finished (False: stopped by SIGTERM)."""
        c = self.config
        if self.rank == 0:
            n_params = sum(p.numel() for p in self.plan.model.parameters())
            overrides = f" with {', '.join(f'{k}={v}' for k, v in c.model.args.items())}" if c.model.args else ""
            data = " ".join(x for x in (c.data.dataset or "auto", c.data.dataset_path) if x)
            print(
                f"plait-train: {c.model.name} {c.model.flavor}{overrides} ({n_params / 1e6:.1f}M params) on "
                f"{self.plan.dims.world_size} x {self.device.type}, {self.plan.dims}, dp mode {self.pm.dp_mode}, "
                f"dtype {c.training.dtype}, {torch.get_num_threads()} threads/rank, global batch "
                f"{c.training.local_batch_size * c.training.gradient_accumulation_steps * self.plan.dims.dp} x "
                f"{c.training.seq_len} tokens of {data}",
                flush=True,
            )
            # The user's own words, if any (the shipped configs set none: a fixed text there was
            # wrong as soon as --model.name or --data.dataset changed the run).
            if c.job.description:
                print(f"plait-train: {c.job.description}", flush=True)
            os.makedirs(c.job.dump_folder, exist_ok=True)
            with open(os.path.join(c.job.dump_folder, "config.toml"), "w") as f:
                f.write(to_toml(c))
        if c.checkpoint.create_seed_checkpoint:
            path = self.checkpointer.save_seed()
            if self.rank == 0:
                print(f"plait-train: seed checkpoint {path} written; start runs from it.", flush=True)
            return True
        metrics = self._metrics()
        stop = _StopSignal()
        if isinstance(self.loader, PrefetchingLoader):
            self.loader.should_stop = lambda: stop.requested
        data_iter = iter(self.loader)
        start, start_step = time.perf_counter(), self.step
        first_loss = last_loss = None
        finished = self.step >= c.training.steps
        stop_now = data_stalled = False
        try:
            with _profiler(c, self.rank, self.device) as prof:
                while self.step < c.training.steps:
                    self.step += 1
                    t0 = time.perf_counter()
                    try:
                        micro_batches = next(data_iter)
                    except StopIteration:
                        raise ConfigError(
                            f"data.dataset = {c.data.dataset!r} ran out of batches at step {self.step}."
                        ) from None
                    except DataError as e:  # a bad row: every rank raises the same (see data/stream.py)
                        raise ConfigError(f"data.dataset = {c.data.dataset!r} at step {self.step}: {e}") from None
                    except DataWaitStopped:
                        # SIGTERM while this rank's batch never came (a stalled source or exchange):
                        # stop unfinished without a save (its collectives could wait on the stall too).
                        self.step -= 1
                        stop_now = data_stalled = True
                        print(f"plait-train: rank {self.rank}: SIGTERM while waiting for data, stopped after "
                              f"step {self.step} (not saved now).", flush=True)
                        break
                    if self.pipeline is not None:
                        micro_batches = merge_micro_batches(micro_batches)
                    _test_fault(self.step)
                    self._read_documents(micro_batches)
                    data_s = time.perf_counter() - t0
                    lr = self.scheduler.get_last_lr()[0]
                    with self.step_sentinel or contextlib.nullcontext():
                        loss, norm = self.train_step(micro_batches)
                    extra = self.moe.step_metrics() if self.moe else None
                    if self.step_sentinel is not None:
                        syncs, violations = self.step_sentinel.step_counts()[-1]
                        extra = {**(extra or {}), "host_syncs": syncs, "precondition_violations": violations}
                    metrics.record(self.step, loss, norm, lr, data_s, extra)
                    if prof is not None:
                        prof.step()
                    last = self.step == c.training.steps
                    log_now = self.step % c.metrics.log_freq == 0 or last
                    # Agreeing on a stop is a collective with a host sync: every step on CPU (cheap),
                    # only at log steps on GPU.
                    stop_now = not last and (log_now or self.device.type == "cpu") and stop.agreed(self.device)
                    if log_now or stop_now:
                        rows = metrics.flush()
                        first_loss = rows[0]["loss"] if first_loss is None else first_loss
                        last_loss = rows[-1]["loss"]
                        self._check_finite(rows)
                    elif self.checkpointer.due(self.step, last=last, stopping=stop_now):
                        self._check_finite_before_save(metrics)
                    self.checkpointer.after_step(self.step, last=last, stopping=stop_now)
                    if stop_now:
                        if self.rank == 0:
                            print(f"plait-train: SIGTERM, stopped after step {self.step}.", flush=True)
                        break
                    if c.data.val_interval and (self.step % c.data.val_interval == 0 or last):
                        t_val = time.perf_counter()
                        metrics.log_scalars(self.step, {"val_loss": self.validate_loss()})
                        metrics.exclude(time.perf_counter() - t_val)  # not training throughput
                finished = self.step >= c.training.steps and not stop_now
            self.checkpointer.close()
            # The prefetch thread ends after its last exchange (a stalled one never does: left, a daemon).
            if hasattr(self.loader, "close") and not data_stalled:
                self.loader.close()
        except TrainingDiverged as e:
            # Every rank is here at the same step (the verdict came from all-reduced values): a save
            # still in flight holds an earlier, finite state, so it is published before stopping.
            self.checkpointer.close()
            raise TrainingDiverged(f"{e} {self.checkpointer.last_good_note()}") from None
        finally:
            if not dist.is_initialized():
                # After an error, write what was recorded (alone: other ranks may not reach a collective).
                with contextlib.suppress(Exception):
                    metrics.flush()
            metrics.close()
            stop.restore()
        dropped = self.moe.dropped_total() if self.moe is not None else None
        if self.rank == 0 and dropped is not None:
            print(f"plait-train: expert capacity dropped {dropped} (token, expert) pairs on rank 0.", flush=True)
        if self.rank == 0 and first_loss is None and not data_stalled:
            print(f"plait-train: already at step {self.step} of {c.training.steps}; nothing to train.", flush=True)
        elif self.rank == 0:
            print(
                f"plait-train: {self.step - start_step} steps in {time.perf_counter() - start:.1f} s"
                f"{f' (steps {start_step + 1}-{self.step})' if start_step else ''}, loss {first_loss:.4f} -> "
                f"{last_loss:.4f}; metrics in {os.path.join(c.job.dump_folder, 'metrics.jsonl')}",
                flush=True,
            )
            if not c.checkpoint.enable:
                print("plait-train: no checkpoint was saved (checkpoint.enable = false): this run cannot be resumed "
                      "or exported; pass --checkpoint.enable true (and --checkpoint.interval N) to save, and run "
                      "the same command again to resume.", flush=True)
        return finished


def exit_code_of(error: BaseException) -> int:
    """The code plait-train exits with for an exception that ends the run (exit_codes.py)."""
    if isinstance(error, TrainingDiverged):
        return exit_codes.DIVERGED
    if isinstance(error, KeyboardInterrupt):
        return exit_codes.INTERRUPTED
    if out_of_memory(error):
        return exit_codes.OUT_OF_MEMORY
    if infrastructure_fault(error):
        return exit_codes.INFRA
    if isinstance(error, ConfigError) or type(error).__name__ == "CheckpointException":
        return exit_codes.CONFIG
    return exit_codes.ERROR


# What a collective raises on the ranks that survive a rank that died (gloo / NCCL), by message.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
              "nccl error", "ncclremoteerror", "timed out", "process group has been destroyed")


# What torch raises when memory runs out where it is not an OutOfMemoryError (the CPU allocator).
_OUT_OF_MEMORY = ("defaultcpuallocator: can't allocate memory", "out of memory", "cannot allocate memory")


def out_of_memory(error: BaseException) -> bool:
    """Device or host memory ran out: the same config runs out again (not requeued)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _OUT_OF_MEMORY)


def infrastructure_fault(error: BaseException) -> bool:
    """A fault of the machine rather than of the run: I/O, a lost rank, a collective timeout
    (requeue-able). Not out of memory (out_of_memory), not a collective mismatch (a bug)."""
    if out_of_memory(error):
        return False
    if isinstance(error, exit_codes.InfrastructureFault):
        return True
    if isinstance(error, OSError) and not isinstance(error, (FileNotFoundError, NotADirectoryError,
                                                             IsADirectoryError, PermissionError)):
        return True  # ENOSPC, EIO, EROFS, ...; a missing or forbidden path is a configuration error
    if isinstance(error, (dist.DistError, RuntimeError)):
        text = str(error).lower()
        if "mismatch" in text:  # ranks disagree on a collective: a bug or a config, not the machine
            return False
        return isinstance(error, dist.DistError) or any(m in text for m in _LOST_PEER)
    return False


def run(config: Config) -> bool:
    """One run; whether it finished its training.steps (False: stopped early by SIGTERM).

    An exception that ends the run leaves with `plait_exit_code` (the code, settled against the
    previous run's failure: exit_codes.settle) and `plait_exit_why`."""
    trainer = None
    code = exit_codes.ERROR
    try:
        trainer = Trainer(config)
        finished = trainer.train()
        code = exit_codes.FINISHED if finished else exit_codes.STOPPED
        return finished
    except BaseException as e:
        code = exit_code_of(e)
        if trainer is not None and code != exit_codes.INTERRUPTED:
            rank_notes.note_failure(config.job.dump_folder, trainer.rank, trainer.step, e)
        if trainer is not None and trainer.rank == 0:
            exit_codes.record_failure(config.job.dump_folder, trainer.step, code)
        if trainer is not None:
            settled, why = trainer.release(code)
            trainer = None
            e.plait_exit_code, e.plait_exit_why = settled, why
        raise
    finally:
        if trainer is not None:
            trainer.release(code)
        destroy_distributed()


# PLAIT_TEST_FAULT="<step>:<kind>": raise at that step what the fault raises (tests of the exit
# codes with real processes): oom (torch's CPU allocator), lost_peer (a collective after a peer died).
TEST_FAULT = "PLAIT_TEST_FAULT"
_TEST_FAULTS = {
    "oom": lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                                "you tried to allocate 393215999999 bytes."),
    "lost_peer": lambda: RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
}


def _test_fault(step: int) -> None:
    spec = os.environ.get(TEST_FAULT)
    if spec:
        at, kind = spec.split(":")
        if int(at) == step:
            raise _TEST_FAULTS[kind]()
