"""Test-only modes that watch a context-parallel step: what each attention kernel is handed, and
what would block the host on a GPU (tensors built from Python data, .item(), .tolist(), ...)."""

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.contextparallel.kernels import flash_input_problems

aten = torch.ops.aten

# Forward ops take (q, k, v, ...); backward ops (dout, q, k, v, out, lse, ...).
FORWARD_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default}
BACKWARD_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
}


class KernelInputCheck(TorchDispatchMode):
    """Records every flash-attention kernel call and its inputs' CUDA-precondition problems."""

    def __init__(self):
        super().__init__()
        self.forward_calls = self.backward_calls = 0
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in FORWARD_OPS:
            self.forward_calls += 1
            q, k, v = args[:3]
            self._note(func, flash_input_problems(q, k, v))
        elif func in BACKWARD_OPS:
            self.backward_calls += 1
            dout, q, k, v, out, lse = args[:6]
            self._note(func, flash_input_problems(q, k, v, out=out, dout=dout, lse=lse))
        return func(*args, **(kwargs or {}))

    def _note(self, func, problems):
        self.problems += [f"{func}: {p}" for p in problems]


# Each of these blocks the host on CUDA: a tensor built from Python data (torch.tensor, as_tensor:
# a pageable host-to-device copy), a read back (.item(), bool()), a data-dependent output shape.
# A dispatch mode, unlike a function mode, also sees inside autograd.Function backwards.
_HOST_SYNC_OPS = {
    aten.lift_fresh.default: "tensor from Python data",
    aten._local_scalar_dense.default: "read to the host (.item() / bool())",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
}


class HostDataCounter(TorchDispatchMode):
    """Records ops that would sync the host with the device, with the Python line that made them.
    (.tolist() on CPU dispatches nothing; on CUDA it copies to the host and shows as _to_copy.)"""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        what = _HOST_SYNC_OPS.get(func)
        if what is None and func is aten._to_copy.default and kwargs and "device" in kwargs:
            if kwargs["device"] is not None and torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu":
                what = "copy to the host"
        if what is not None:
            frame = next(
                (f for f in reversed(traceback.extract_stack()) if "/torch/" not in f.filename and f.filename != __file__),
                None,
            )
            self.calls.append(f"{what} at {frame.filename}:{frame.lineno}" if frame else what)
        return func(*args, **(kwargs or {}))
