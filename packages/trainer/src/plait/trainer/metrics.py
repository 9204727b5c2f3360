"""Per-step metrics without per-step host syncs.

Each step's loss and gradient norm stay on the device; every `log_freq` steps (and at the end)
the window is flushed: one all-reduce of the stacked losses over the data-parallel x cp ranks,
one device-to-host copy, then one metrics.jsonl line per step, a console line, tensorboard
scalars (and the same scalars to Weights & Biases under metrics.wandb: wandb_logger.py) and the
tqdm bar. Throughput, MFU and memory are window averages (a step's own wall
time is not known without a sync); data-loading time is per step (host time). On CUDA each
row also has `device_step_s`, the step's own time by CUDA events: from the event recorded after
the previous step's work (or at the window's start, or after a validation) to the one after this
step's, read at the flush (no sync of its own).
"""

import contextlib
import errno
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.models.cpu_bf16 import cpu_multiplies_in_fp32

from .config import Config
from .exit_codes import InfrastructureFault
from .wandb_logger import WandbRun

# Dense bf16 peak TFLOP/s per GPU (no sparsity).
PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "B200": 2250.0}


def measure_cpu_tflops(dtype: torch.dtype, seconds: float = 0.3) -> float:
    """Peak matmul TFLOP/s of this process's threads: the fastest of repeated square matmuls
    (the fastest, not the mean, so a briefly busy machine does not lower the peak), in the kernel
    the models' products of `dtype` run: fp32 for bf16 on a CPU that emulates bf16
    (plait.models.cpu_bf16), whose emulated bf16 kernel would understate the peak 4-5x."""
    n = 1024
    if cpu_multiplies_in_fp32(dtype):
        dtype = torch.float32
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm up (oneDNN primitive creation)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, cpu_peak: float = 0.0) -> float:
    """Per-device peak for MFU: the GPU table (bf16 dense), or the CPU's (configured or measured)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_TFLOPS_BF16.items():
            if key in name:
                return value
        return float("nan")
    return cpu_peak if cpu_peak > 0 else measure_cpu_tflops(dtype)


def memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is KiB on Linux


def _open_jsonl(path: str, start_step: int):
    """metrics.jsonl for writing. A run resumed after `start_step` keeps the rows of steps up to
    it and drops later ones (written after that checkpoint by the run that died), then appends."""
    kept = []
    if start_step > 0 and os.path.isfile(path):
        with open(path, "rb") as f:  # bytes: a damaged line (not UTF-8) must not block the resume
            for raw in f:
                try:
                    line = raw.decode()
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a kill, or damaged (UnicodeDecodeError is a ValueError)
    jsonl = open(path, "w")
    jsonl.writelines(kept)
    jsonl.flush()
    return jsonl


@dataclass
class _Window:
    steps: list[int] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    extras: list[dict] = field(default_factory=list)  # per step: name -> device tensor or number
    start: float = field(default_factory=time.perf_counter)
    excluded_s: float = 0.0  # time inside the window that was not training (validation)
    # CUDA timing events: each recorded step's (start, end), and where the next step starts
    step_events: list = field(default_factory=list)
    next_start: object = None


def _device_event(device: torch.device):
    """A timing event recorded now on the device's current stream (CUDA), else None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class MetricsLogger:
    """Collects steps on the device and writes them at flush time (rank 0 writes files)."""

    def __init__(
        self,
        dump_folder: str,
        rank: int,
        world_size: int,
        device: torch.device,
        loss_mesh: DeviceMesh | None,
        tokens_per_step_per_rank: float,
        flops_per_token: float,
        peak_tflops_per_rank: float,
        tensorboard: bool,
        total_steps: int,
        progress_bar: bool,
        start_step: int = 0,
        wandb_config: Config | None = None,
    ):
        """`wandb_config`: the run's configuration, to also log to Weights & Biases (rank 0) with it as
        the W&B run's config; None: no W&B."""
        self.rank = rank
        self.dump_folder = dump_folder
        self.world_size = world_size
        self.device = device
        self.loss_mesh = loss_mesh
        self.tokens_per_rank = tokens_per_step_per_rank
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops_per_rank
        self.window = self._new_window()
        self.last: dict = {}
        self.jsonl = None
        self.tb = None
        self.wandb = None
        self.bar = None
        if rank == 0:
            Path(dump_folder).mkdir(parents=True, exist_ok=True)
            if wandb_config is not None:  # first: if it cannot start, nothing else is open yet
                self.wandb = WandbRun(wandb_config, dump_folder)
            self.jsonl = _open_jsonl(os.path.join(dump_folder, "metrics.jsonl"), start_step)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(dump_folder, "tb"))
            if progress_bar and sys.stderr.isatty():  # a bar in a log file is noise: plain lines there
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, leave=False)

    def record(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, data_s: float, extra: dict | None = None
    ) -> None:
        """Keep one step's values (device tensors, no sync). `extra`: more named values of this
        rank (MoE load imbalance per layer, drops, host syncs), scalars or 1-D tensors."""
        w = self.window
        w.steps.append(step)
        # [1 + K] under multi-token prediction: the main loss, then each depth's.
        w.losses.append(loss.detach().float().reshape(-1))
        w.grad_norms.append(grad_norm.detach().float().reshape(()).to(loss.device))
        w.lrs.append(lr)
        w.data_s.append(data_s)
        w.extras.append(dict(extra or {}))
        end = _device_event(self.device)
        if end is not None:
            w.step_events.append((w.next_start, end))
            w.next_start = end

    def _new_window(self) -> _Window:
        w = _Window()
        w.next_start = _device_event(self.device)  # after the window's clock starts: nested in its wall time
        return w

    def window_finite(self) -> bool:
        """Whether every loss and grad norm recorded since the last flush is finite on every rank:
        one all-reduce over the world and one host sync (called before a checkpoint, not per step)."""
        w = self.window
        if not w.steps:
            return True
        finite = torch.isfinite(torch.cat(w.losses + [g.reshape(1) for g in w.grad_norms])).all().float().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (e.g. validation) out of the current window's throughput."""
        self.window.excluded_s += seconds
        if self.window.next_start is not None:  # and its device work out of the next step's device_step_s
            self.window.next_start = _device_event(self.device)

    def flush(self) -> list[dict]:
        """Write every recorded step; return their rows (all ranks get the same losses)."""
        w = self.window
        if not w.steps:
            return []
        values, extras = self._to_host(w)
        # Read the clock only now: the copy above waited for every kernel the window's steps queued.
        # Read before it, a GPU step that never blocks the host would be timed by its launches alone.
        elapsed = time.perf_counter() - w.start - w.excluded_s
        n = len(w.steps)
        step_s = elapsed / n
        tps_rank = self.tokens_per_rank / step_s
        tflops = self.flops_per_token * tps_rank / 1e12
        mem = memory_gib(self.device)
        # The copy above waited for every event too: elapsed_time needs no sync of its own.
        device_s = [start.elapsed_time(end) / 1e3 for start, end in w.step_events]
        rows = []
        for i, step in enumerate(w.steps):
            rows.append(
                {
                    "step": step,
                    "loss": values[0][i],
                    "grad_norm": values[1][i],
                    "lr": w.lrs[i],
                    "tokens_per_second": tps_rank * self.world_size,
                    "tokens_per_second_per_rank": tps_rank,
                    "tflops_per_rank": tflops,
                    "mfu": tflops / self.peak if self.peak and not math.isnan(self.peak) else float("nan"),
                    "memory_gib": mem,
                    "step_time_s": step_s,
                    "data_time_s": w.data_s[i],
                    **({"device_step_s": device_s[i]} if len(device_s) == n else {}),
                    **extras[i],
                }
            )
        self.window = self._new_window()
        self.last = rows[-1]
        if self.rank == 0:
            self._write(rows)
        return rows

    def _to_host(self, w: _Window) -> tuple[list[list[float]], list[dict]]:
        """The window's losses (averaged over the loss mesh), grad norms and extras on the host: the
        flush's host sync."""
        losses = torch.stack(w.losses)  # [steps, 1 + K]
        if self.loss_mesh is not None:
            # The one collective of a log step: the mean loss over every rank that saw different data.
            # (SUM then divide: gloo has no AVG.)
            dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=self.loss_mesh.get_group())
            losses = losses / self.loss_mesh.size()
        values = torch.cat([losses, torch.stack(w.grad_norms)[:, None]], 1).t().cpu().tolist()
        extras = _extras_to_host(w.extras, losses.device)
        for i, row in enumerate(extras):  # multi-token prediction: each depth's loss, by depth
            if len(values) > 2:
                row["mtp_loss"] = [depth[i] for depth in values[1:-1]]
        return [values[0], values[-1]], extras

    def _write(self, rows: list[dict]) -> None:
        with self._writing():
            # Writes into a deleted folder fail late and in TensorBoard's writer thread (or never:
            # the open metrics.jsonl is unlinked, not closed); one stat per log step says it now.
            if not os.path.isdir(self.dump_folder):
                raise FileNotFoundError(errno.ENOENT, "the folder no longer exists", str(self.dump_folder))
            for row in rows:
                self.jsonl.write(json.dumps(row) + "\n")
                if self.tb is not None or self.wandb is not None:
                    scalars = _scalars(row)
                    if self.tb is not None:
                        for key, value in scalars.items():
                            self.tb.add_scalar(key, value, row["step"])
                    if self.wandb is not None:
                        self.wandb.log(row["step"], scalars)
            self.jsonl.flush()
        last = rows[-1]
        line = (
            f"step {last['step']:>6}  loss {last['loss']:8.4f}  grad_norm {last['grad_norm']:7.3f}  "
            f"lr {last['lr']:.2e}  tok/s {last['tokens_per_second']:9.0f} ({last['tokens_per_second_per_rank']:.0f}/rank)  "
            f"TFLOP/s {last['tflops_per_rank']:.3f}/rank  mfu {100 * last['mfu']:5.1f}%  "
            f"mem {last['memory_gib']:.2f} GiB  data {1000 * last['data_time_s']:.1f} ms"
        )
        if "moe_imbalance" in last:
            line += f"  moe max/mean {max(last['moe_imbalance']):.2f}"
        if "moe_ep_imbalance" in last:
            line += f" (ep rank {max(last['moe_ep_imbalance']):.2f})"
        if "mtp_loss" in last:
            line += "  mtp " + " ".join(f"{loss:.4f}" for loss in last["mtp_loss"])
        if self.bar is not None:
            self.bar.update(len(rows))
            self.bar.set_postfix(loss=f"{last['loss']:.4f}", refresh=False)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def log_scalars(self, step: int, values: dict) -> None:
        """Extra scalars (validation): console, a metrics.jsonl row of their own ({"step", "val_loss"};
        training rows are the ones with "loss") and tensorboard, on rank 0."""
        if self.rank != 0:
            return
        text = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
        (self.bar.write if self.bar is not None else print)(f"step {step:>6}  {text}")
        if self.jsonl is not None:
            with self._writing():
                self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
                self.jsonl.flush()
        if self.tb is not None:
            with self._writing():
                for key, value in values.items():
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(step, values)

    @contextlib.contextmanager
    def _writing(self):
        """Metrics files that cannot be written (the dump folder deleted while the run runs, a full
        disk): one line naming the folder and the cause (exit 74), not TensorBoard's traceback."""
        try:
            yield
        except OSError as e:
            self.tb = None  # its writer is broken; close() must not raise again
            raise InfrastructureFault(
                f"metrics: cannot write under {self.dump_folder}: {e.strerror or e} (was job.dump_folder deleted "
                "or its disk filled while the run was running?)"
            ) from None

    def close(self, failed: bool | None = None) -> None:
        """`failed`: whether the run ends by an error (the W&B run is marked failed); None: whether an
        exception is propagating through the caller's `finally` that calls close()."""
        if failed is None:
            failed = sys.exc_info()[0] is not None
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            with contextlib.suppress(OSError):  # a broken writer was reported where it broke
                self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish(failed)
            self.wandb = None


def _scalars(row: dict) -> dict[str, float]:
    """A metrics row as the scalars TensorBoard and W&B get: finite numbers by name, a per-layer list
    as one curve each (`moe_imbalance/0`, ...), the step itself left out (it is the x axis)."""
    scalars = {}
    for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            scalars[key] = value
        elif isinstance(value, list):  # per layer: one curve each
            for i, v in enumerate(value):
                scalars[f"{key}/{i}"] = v
    return scalars


def _extras_to_host(extras: list[dict], device: torch.device) -> list[dict]:
    """Every step's extra values as Python numbers / lists, with one device-to-host copy."""
    tensors = [(i, k, v) for i, row in enumerate(extras) for k, v in row.items() if isinstance(v, torch.Tensor)]
    host = [dict((k, v) for k, v in row.items() if not isinstance(v, torch.Tensor)) for row in extras]
    if tensors:
        flat = torch.cat([v.detach().float().reshape(-1).to(device) for _, _, v in tensors]).cpu().tolist()
        offset = 0
        for i, key, v in tensors:
            n = v.numel()
            values = flat[offset : offset + n]
            host[i][key] = values if v.dim() > 0 else (int(values[0]) if not v.is_floating_point() else values[0])
            offset += n
    return host


def step_profiler(config: Config, rank: int, device: torch.device):
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
