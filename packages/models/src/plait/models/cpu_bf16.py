"""bf16 on the CPU: whether it multiplies bf16 natively, and fp32 kernels where it does not.

A CPU without AVX512-BF16 or AMX has no bf16 arithmetic; torch (oneDNN) emulates it, and the
emulation is slow. On an Intel Xeon without either (2026-11-27, one thread, the DeepSeek-V3 debug
model's shapes) a bf16 `mm` took 3.4-5.2x the time of the same product through fp32 kernels
with the casts in and out counted, `bmm` and `_grouped_mm` 4.3-4.4x, and the flash-attention
kernel 2.3-2.6x. There a bf16 product runs as an fp32 kernel on the bf16 operands (exact in
fp32), accumulated in fp32 and rounded once to bf16: what the emulation computes, in another
order (99.996 % of a 1024 x 256 x 1024 product's outputs bitwise equal, the rest one bf16 ulp).
Autograd saves the bf16 operands, not fp32 copies, so activation memory is that of bf16.

CPUs with bf16 units and every GPU are unchanged. Attention also runs in fp32 on every CPU up to
head dim 16, where torch's flash kernel is faster in fp32 (`cpu_attends_in_fp32`).

`gpu_route()`: within it every CPU-only route answers as a GPU runs (bf16 products and attention
in bf16, no CPU-only padding or batched-matmul experts, whatever this CPU has): what a planner
tracing a GPU's step on the CPU device (fake tensors) must see.
"""

import contextlib
import platform

import torch
import torch.nn.functional as F
from torch import nn


def _has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively: x86 AVX512-BF16 or AMX (torch's private probes, in
    torch.cpu since 2.3; a torch without them counts as none), ARM's BF16 extension (the `bf16`
    feature of /proc/cpuinfo: Graviton 3+, Grace, Apple M2+ under Linux)."""
    if any(getattr(torch.cpu, probe, bool)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")):
        return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            with open("/proc/cpuinfo") as f:
                return any(line.startswith("Features") and "bf16" in line.split() for line in f)
        except OSError:
            return False
    return False


# Read at call time, so a test can take either path on any CPU by setting it.
CPU_BF16_UNITS = _has_bf16_units()
# Which kernels a bf16 product or attention takes on the CPU (the trainer's training.cpu_bf16):
# "auto" fp32 kernels where this CPU emulates bf16 (and attention at head dim <= 16 on any CPU),
# "native" torch's bf16 kernels always, "fp32" fp32 kernels always. Decided here, once: context
# parallel takes the answer as a flag (ContextParallelConfig.cpu_half_in_fp32) and probes nothing.
ROUTES = ("auto", "native", "fp32")
ROUTE = "auto"


def set_route(route: str) -> None:
    """Choose the CPU kernels of bf16 products and attention for this process (ROUTES)."""
    global ROUTE
    if route not in ROUTES:
        raise ValueError(f"cpu_bf16 route {route!r}: use one of {', '.join(ROUTES)}")
    ROUTE = route
# At head_dim 16 (the Llama 3 debug model: batch 8, seq 512, 16 heads) forward + backward took
# about 60 ms in fp32 against 73 ms in bf16 on an AMD EPYC (bf16 units), while from head_dim 32 up
# bf16 was as fast or faster there.
CPU_FP32_MAX_HEAD_DIM = 16
# True only inside `gpu_route()` (read at call time, like CPU_BF16_UNITS).
GPU_ROUTE = False


@contextlib.contextmanager
def gpu_route():
    """Within: the CPU device takes the kernel routes of a GPU (module docstring). For tracing a
    GPU's step with fake tensors (plait-plan); real CPU tensors still compute correctly (bf16 as
    torch's kernels compute it), only slower where the CPU emulates bf16."""
    global GPU_ROUTE
    before, GPU_ROUTE = GPU_ROUTE, True
    try:
        yield
    finally:
        GPU_ROUTE = before


def cpu_attends_in_fp32(head_dim: int) -> bool:
    """Whether a half-precision attention on this CPU runs in fp32: where that is faster under the
    "auto" route, always under "fp32", never under "native" (nor under gpu_route)."""
    if GPU_ROUTE or ROUTE == "native":
        return False
    return ROUTE == "fp32" or head_dim <= CPU_FP32_MAX_HEAD_DIM or not CPU_BF16_UNITS


def cpu_multiplies_in_fp32(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether a product computed in `dtype` on `device` runs through fp32 kernels: bf16 on a CPU
    that emulates it under "auto", always under "fp32", never under "native" (nor under gpu_route)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or GPU_ROUTE or ROUTE == "native":
        return False
    return ROUTE == "fp32" or not CPU_BF16_UNITS


# Asked once, at import: dynamo on torch 2.11 cannot trace `torch.amp.is_autocast_available`, and a
# graph break there split every compiled document-masked block in two.
_AUTOCAST_DEVICES = frozenset(t for t in ("cpu", "cuda", "xpu", "mps", "hpu") if torch.amp.is_autocast_available(t))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a product of `x` computes in: autocast's where it is on for x's device."""
    device_type = x.device.type
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class _LinearInFp32(torch.autograd.Function):
    """`F.linear` of bf16 operands through fp32 kernels, forward and backward; saves the bf16 ones."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        with torch.autocast(x.device.type, enabled=False):
            g = grad_y.float()
            if ctx.needs_input_grad[0]:
                grad_x = (g @ weight.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = (g.flatten(0, -2).t() @ x.float().flatten(0, -2)).to(weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_bias = g.flatten(0, -2).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias


class _BmmInFp32(torch.autograd.Function):
    """`torch.bmm` of bf16 operands through fp32 kernels, forward and backward."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            return torch.bmm(a.float(), b.float()).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        with torch.autocast(a.device.type, enabled=False):
            g = grad.float()
            if ctx.needs_input_grad[0]:
                grad_a = torch.bmm(g, b.float().transpose(1, 2)).to(a.dtype)
            if ctx.needs_input_grad[1]:
                grad_b = torch.bmm(a.float().transpose(1, 2), g).to(b.dtype)
        return grad_a, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through fp32 kernels for bf16 (or bf16 autocast) on a CPU that emulates bf16."""
    if x.device.type != "cpu" or CPU_BF16_UNITS or GPU_ROUTE:  # GPUs and bf16 CPUs: torch's op, no more checks
        return F.linear(x, weight, bias)
    dtype = compute_dtype(x)
    if not cpu_multiplies_in_fp32(dtype):
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled("cpu"):  # autocast's casts for a linear, done here
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif weight.dtype != dtype:  # mixed dtypes without autocast: torch's own error
        return F.linear(x, weight, bias)
    return _LinearInFp32.apply(x, weight, bias)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm` of operands of one dtype, through fp32 kernels where `cpu_multiplies_in_fp32`."""
    if cpu_multiplies_in_fp32(a.dtype, a.device) and b.dtype == a.dtype:
        return _BmmInFp32.apply(a, b)
    return torch.bmm(a, b)


class Linear(nn.Linear):
    """`nn.Linear` whose bf16 product runs through fp32 kernels on a CPU that emulates bf16.

    Everything else is `nn.Linear`'s: parameters, state-dict keys, `isinstance` checks (tensor
    parallel's plans), the output on every GPU and on CPUs with bf16 units."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
