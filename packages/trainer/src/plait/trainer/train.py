"""One training run: validate -> process group -> meshes -> model -> optimizer -> data -> resume -> loop.

The loop keeps everything on the device between log steps: losses and gradient norms are
recorded as tensors and flushed every `metrics.log_freq` steps (metrics.py), which is also when
non-finite losses are caught and a SIGTERM is agreed on across ranks. Before every checkpoint the
steps since the last flush are checked too (one all-reduce and one host sync per save), so a
non-finite state is never published and never makes `keep_last` prune a good one.
"""

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.data.prefetch import DataWaitStopped, PrefetchingLoader
from plait.data.sources import DataError
from plait.mesh import build_meshes, destroy_distributed, init_distributed
from plait.models import cpu_bf16

from . import exit_codes, rank_notes
from .checkpoint import CheckpointManager
from .config import Config, ConfigError, to_toml
from .failures import TrainingDiverged, check_finite, exit_code_of, test_fault
from .log import EVERY_RANK, log
from .lr_scheduler import build_lr_scheduler
from .metrics import MetricsLogger, peak_tflops, step_profiler
from .moe_step import MoEStep
from .optimizer import build_optimizer
from .parallelize import parallelize
from .pipeline import merge_micro_batches
from .run_data import build_loader, data_exchange
from .run_lock import take_run_locks
from .step import StepRunner, cross_entropy_loss, token_loss_fn
from .stop_signal import StopSignal
from .validate import validate
from .validation import validation_loss


def _set_determinism(config: Config) -> None:
    torch.manual_seed(config.job.seed)
    if config.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


class Trainer:
    # Tests set a plait.testing.sentinel.StepSentinel here: entered around each train_step, its counts
    # go into that step's metrics row (host_syncs, precondition_violations; rank 0's, as written).
    step_sentinel = None

    def __init__(self, config: Config):
        self.config = config
        self.plan = validate(config, check_memory=True)  # before any collective
        _set_determinism(config)
        cpu_bf16.set_route(config.training.cpu_bf16)  # the models' CPU kernels; context parallel's follow
        self.dist = init_distributed(config.comm.backend, timeout_s=config.job.collective_timeout_s)
        self.device = self.dist.device
        self.rank = self.dist.rank
        self.lock = take_run_locks(config, self.rank)
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
        self.optimizer = build_optimizer(self.pm.inner, config.optimizer, self.device, config.job.seed)
        self.scheduler = build_lr_scheduler(self.optimizer, config.training.steps, config.lr_scheduler)
        self.loader = build_loader(
            config, self.plan, self.meshes, config.data.dataset, "train", config.training.gradient_accumulation_steps,
            data_exchange(),
        )
        # A replica group that joins takes a peer's data position: no batches read ahead of it.
        if config.data.prefetch and not config.fault_tolerance.enable:
            self.loader = PrefetchingLoader(self.loader, config.data.prefetch)
        self._validation_exchange = None  # made at the first validation (every rank validates then)
        self.moe = MoEStep.for_model(
            self.pm.inner, self.plan.model_args, self.meshes, self.pm.dispatchers,
            whole_model=self.plan.model if self.pm.stages else None,
        )
        # Under training.compile the loss is compiled too (the fp32 upcast fuses into the
        # log-softmax); not on tensor-parallel (DTensor) logits.
        # (training.loss = chunked: the loss head compiles its own chunked loss, loss_head.py.)
        compile_loss = config.training.compile and self.plan.dims.tp == 1 and config.training.loss == "full"
        self.loss_fn = torch.compile(cross_entropy_loss) if compile_loss else token_loss_fn(config)
        self.checkpointer = CheckpointManager(
            config, self.plan.dims, self.pm.inner, self.optimizer, self.scheduler, self.loader, self.rank
        )
        self.pipeline = None
        if self.pm.stages:
            from .pipeline import build_trainer_pipeline

            self.pipeline = build_trainer_pipeline(config, self.plan, self.meshes, self.pm, self.loss_fn, self.device)
        self.runner = StepRunner(config, self.plan, self.meshes, self.pm, self.optimizer, self.scheduler, self.device,
                                 moe=self.moe, loss_fn=self.loss_fn, pipeline=self.pipeline)  # fmt: skip
        self.step = self.checkpointer.load()  # the last completed step: 0, or a resumed checkpoint's
        self.replicas = None
        if config.fault_tolerance.enable:
            from .fault_tolerance import ReplicaGroupRun

            self.replicas = ReplicaGroupRun(config, self, self.rank, self.dist.world_size)
            self.runner.replica_group = self.replicas.group

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
            return validation_loss(self)
        finally:
            self.model.train()

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

    def _check_finite_before_save(self, metrics: MetricsLogger) -> None:
        """Raise TrainingDiverged if any step since the last flush was non-finite on any rank."""
        if not metrics.window_finite():
            check_finite(metrics.flush())  # the rows name the first bad step

    def train(self) -> bool:
        """Train to training.steps; return whether the run finished (False: stopped by SIGTERM)."""
        c = self.config
        self._announce()
        if c.checkpoint.create_seed_checkpoint:
            path = self.checkpointer.save_seed()
            log.info(f"seed checkpoint {path} written; start runs from it.")
            return True
        loop = _Loop(metrics=self._metrics(), stop=StopSignal(), start_step=self.step)
        if isinstance(self.loader, PrefetchingLoader):
            self.loader.should_stop = lambda: loop.stop.requested
        finished = self.step >= c.training.steps
        try:
            semi_sync = self.replicas.semi_sync() if self.replicas is not None else None
            with step_profiler(c, self.rank, self.device) as prof, semi_sync or contextlib.nullcontext():
                self._loop(loop, iter(self.loader), prof)
                finished = self.step >= c.training.steps and not loop.stop_now
            self.checkpointer.close()
            # The prefetch thread ends after its last exchange (a stalled one never does: left, a daemon).
            if hasattr(self.loader, "close") and not loop.data_stalled:
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
                    loop.metrics.flush()
            loop.metrics.close()
            loop.stop.restore()
        self._report(loop)
        return finished

    def _announce(self) -> None:
        """Rank 0: what runs, on what, and its effective configuration (config.toml)."""
        if self.rank != 0:
            return
        c = self.config
        n_params = sum(p.numel() for p in self.plan.model.parameters())
        overrides = f" with {', '.join(f'{k}={v}' for k, v in c.model.args.items())}" if c.model.args else ""
        data = " ".join(x for x in (c.data.dataset or "auto", c.data.dataset_path) if x)
        log.info(
            f"{c.model.name} {c.model.flavor}{overrides} ({n_params / 1e6:.1f}M params) on "
            f"{self.plan.dims.world_size} x {self.device.type}, {self.plan.dims}, dp mode {self.pm.dp_mode}, "
            f"dtype {c.training.dtype}, {torch.get_num_threads()} threads/rank, global batch "
            f"{c.training.local_batch_size * c.training.gradient_accumulation_steps * self.plan.dims.dp} x "
            f"{c.training.seq_len} tokens of {data}"
        )
        # The user's own words, if any (the shipped configs set none: a fixed text there was
        # wrong as soon as --model.name or --data.dataset changed the run).
        if c.job.description:
            log.info(c.job.description)
        os.makedirs(c.job.dump_folder, exist_ok=True)
        with open(os.path.join(c.job.dump_folder, "config.toml"), "w") as f:
            f.write(to_toml(c))

    def _loop(self, loop: "_Loop", data_iter, prof) -> None:
        c = self.config
        while self.step < c.training.steps:
            if self.replicas is not None:
                self.replicas.begin_step()  # a group behind the quorum takes a peer's state (and step)
                if self.step >= c.training.steps:
                    break
            self.step += 1
            t0 = time.perf_counter()
            micro_batches = self._next_batch(data_iter, loop)
            if micro_batches is None:
                break
            data_s = time.perf_counter() - t0
            lr = self.scheduler.get_last_lr()[0]
            with self.step_sentinel or contextlib.nullcontext():
                loss, norm = self.train_step(micro_batches)
            if not self.runner.committed:  # a replica group was lost in this step: every group drops it
                log.info(f"fault tolerance: step {self.step} was not committed (a replica group was lost); "
                         "its batch is skipped and the step runs again on the next one")
                self.step -= 1
                continue
            extra = self.moe.step_metrics() if self.moe else None
            if self.replicas is not None:
                extra = {**(extra or {}), "quorum": self.replicas.participants}
            if self.step_sentinel is not None:
                syncs, violations = self.step_sentinel.step_counts()[-1]
                extra = {**(extra or {}), "host_syncs": syncs, "precondition_violations": violations}
            loop.metrics.record(self.step, loss, norm, lr, data_s, extra)
            if prof is not None:
                prof.step()
            if self._after_step(loop):
                break

    def _next_batch(self, data_iter, loop: "_Loop"):
        """This step's micro-batches, or None when a SIGTERM came while this rank waited for them."""
        c = self.config
        try:
            micro_batches = next(data_iter)
        except StopIteration:
            raise ConfigError(f"data.dataset = {c.data.dataset!r} ran out of batches at step {self.step}.") from None
        except DataError as e:  # a bad row: every rank raises the same (see data/stream.py)
            raise ConfigError(f"data.dataset = {c.data.dataset!r} at step {self.step}: {e}") from None
        except DataWaitStopped:
            # SIGTERM while this rank's batch never came (a stalled source or exchange):
            # stop unfinished without a save (its collectives could wait on the stall too).
            self.step -= 1
            loop.stop_now = loop.data_stalled = True
            log.info(f"SIGTERM while waiting for data, stopped after step {self.step} (not saved now).",
                     extra=EVERY_RANK)
            return None
        if self.pipeline is not None:
            micro_batches = merge_micro_batches(micro_batches)
        test_fault(self.step)
        self._read_documents(micro_batches)
        return micro_batches

    def _after_step(self, loop: "_Loop") -> bool:
        """Log, agree on a stop, check finiteness, save, validate; whether the loop stops here."""
        c = self.config
        last = self.step == c.training.steps
        # The first step this process trains logs too (as torchtitan's step 1): a new run, or a
        # resumed one, shows its loss within seconds, not after log_freq steps. Its row's
        # tokens/s carries the start-up (first kernels, compile); the next window's does not.
        log_now = self.step % c.metrics.log_freq == 0 or last or self.step == loop.start_step + 1
        # Agreeing on a stop is a collective with a host sync: every step on CPU (cheap),
        # only at log steps on GPU.
        loop.stop_now = not last and (log_now or self.device.type == "cpu") and loop.stop.agreed(self.device)
        if log_now or loop.stop_now:
            rows = loop.metrics.flush()
            loop.first_loss = rows[0]["loss"] if loop.first_loss is None else loop.first_loss
            loop.last_loss = rows[-1]["loss"]
            check_finite(rows)
        elif self.checkpointer.due(self.step, last=last, stopping=loop.stop_now):
            self._check_finite_before_save(loop.metrics)
        if self.replicas is None or self.replicas.should_save_checkpoint():
            self.checkpointer.after_step(self.step, last=last, stopping=loop.stop_now)
        if loop.stop_now:
            log.info(f"SIGTERM, stopped after step {self.step}.")
            return True
        if c.data.val_interval and (self.step % c.data.val_interval == 0 or last):
            t_val = time.perf_counter()
            loop.metrics.log_scalars(self.step, {"val_loss": self.validate_loss()})
            loop.metrics.exclude(time.perf_counter() - t_val)  # not training throughput
        return False

    def _report(self, loop: "_Loop") -> None:
        """Rank 0: what the run did, in one or two lines."""
        c = self.config
        dropped = self.moe.dropped_total() if self.moe is not None else None
        if dropped is not None:
            log.info(f"expert capacity dropped {dropped} (token, expert) pairs on rank 0.")
        if loop.first_loss is None and not loop.data_stalled:
            log.info(f"already at step {self.step} of {c.training.steps}; nothing to train.")
            return
        if loop.first_loss is None:
            return
        start_step = loop.start_step
        log.info(
            f"{self.step - start_step} steps in {time.perf_counter() - loop.started:.1f} s"
            f"{f' (steps {start_step + 1}-{self.step})' if start_step else ''}, loss {loop.first_loss:.4f} -> "
            f"{loop.last_loss:.4f}; metrics in {os.path.join(c.job.dump_folder, 'metrics.jsonl')}"
        )
        if not c.checkpoint.enable:
            log.info("no checkpoint was saved (checkpoint.enable = false): this run cannot be resumed or exported; "
                     "pass --checkpoint.enable true (and --checkpoint.interval N) to save, and run the same "
                     "command again to resume.")


@dataclass
class _Loop:
    """The training loop's state between steps."""

    metrics: MetricsLogger
    stop: StopSignal
    start_step: int
    started: float = field(default_factory=time.perf_counter)
    first_loss: float | None = None
    last_loss: float | None = None
    stop_now: bool = False
    data_stalled: bool = False


def run(config: Config) -> bool:
    """One run; whether it finished its training.steps (False: stopped early by SIGTERM).

    An exception that ends the run leaves with `plait_exit_code` (the code, settled against the
    previous run's failure: exit_codes.settle) and `plait_exit_why`."""
    trainer = replicas = None
    code = exit_codes.ERROR
    try:
        trainer = Trainer(config)
        replicas = trainer.replicas
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
        if replicas is not None:
            replicas.shutdown()
        destroy_distributed()


