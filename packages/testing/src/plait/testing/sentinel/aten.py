"""The aten layer: a TorchDispatchMode that sees the syncs C++ issues, the kernel and collective
arguments (judged by .kernels) and, with a compute dtype, compute kernels run in another dtype."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .host import _is_bool_index, _masked_fill
from .kernels import (
    _COLLECTIVE_EXEMPT,
    _SDPA_PACKETS,
    _collective_violations,
    _grouped_mm_violations,
    _plait_op_violations,
    _sdpa_violations,
    _tensors_of,
)
from .records import _active, _busy, _caller, _record, _suppressed

_SYNC_PACKETS = {
    "_local_scalar_dense": "item",
    "is_nonzero": "item",
    "equal": "item",
    "nonzero": "nonzero",
    "masked_select": "nonzero",
    "_unique": "data_dependent_shape",
    "_unique2": "data_dependent_shape",
    "unique_dim": "data_dependent_shape",
    "unique_consecutive": "data_dependent_shape",
    "unique_dim_consecutive": "data_dependent_shape",
    "bincount": "data_dependent_shape",
    "repeat_interleave": "data_dependent_shape",
    "index": "bool_mask_index",
    "index_put": "bool_mask_index",
    "index_put_": "bool_mask_index",
    "_index_put_impl_": "bool_mask_index",
    "_to_copy": "to_cpu",
    "copy_": "to_cpu",
}
# The compute kernels of a step: in a bf16 step, one of these in another dtype is a dtype-only bug
# (an fp32 expert GEMM found this way looked right in every loss comparison).
_MATMUL_PACKETS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", *_SDPA_PACKETS}
# plait's kernel ops (namespace plait), whose data inputs must be in the step's compute dtype too.
_PLAIT_KERNELS = {"grouped_mm", "document_attention", "document_attention_backward"}


def _record_dtype(func, args, kwargs) -> None:
    for sentinel in _active:
        if sentinel.compute_dtype is not None and sentinel._watching_this_thread():
            off = _off_dtype(func._overloadpacket.__name__, args, kwargs, sentinel.compute_dtype)
            if off is not None:
                where, _ = _caller()
                sentinel.off_dtype_kernels[(func._overloadpacket.__name__, where, off)] += 1


def _off_dtype(packet: str, args, kwargs, dtype: torch.dtype) -> str | None:
    """The dtypes of a compute kernel's data inputs that are not `dtype` (None: all are)."""
    if packet in _SDPA_PACKETS or packet.startswith("document_attention"):
        # q, k, v (backward: grad_out, q, k, v, out); the fp32 log-sum-exp is fp32 by design.
        data = args[:5] if packet.endswith("_backward") else args[:3]
    else:
        data = (*args, *kwargs.values())
    found = {t.dtype for value in data for t in _tensors_of(value) if t.dtype.is_floating_point}
    return ", ".join(sorted(str(d) for d in found - {dtype})) or None


def _sync_detail(packet: str, args, kwargs) -> str | None:
    if packet in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = [i for i in (args[1] if len(args) > 1 else kwargs.get("indices", ())) or () if i is not None]
        if not _is_bool_index(indices):
            return None
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if packet != "index" and not accumulate and _masked_fill(indices, args[2], python_layer=False):
            return None
        return "index with a bool tensor"
    if packet == "repeat_interleave":
        has_repeats = isinstance(args[0], torch.Tensor) and (len(args) == 1 or isinstance(args[1], torch.Tensor))
        return "repeats tensor without output_size" if has_repeats and kwargs.get("output_size") is None else None
    if packet == "_to_copy":
        device = kwargs.get("device")
        moving = device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
        return "device-to-host copy" if moving and not kwargs.get("non_blocking") else None
    if packet == "copy_":
        moving = args[0].device.type == "cpu" and args[1].device.type != "cpu"
        non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
        return "device-to-host copy" if moving and not non_blocking else None
    return packet


def _tracing_type(t) -> bool:
    """Fake / functional tensors (DTensor's sharding propagation, tracing): no data, nothing runs."""
    return t.__name__ in ("FakeTensor", "FunctionalTensor")


def _has_subclass(types) -> bool:
    return any(t is not torch.Tensor and t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ for t in types)


class _AtenMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_tracing_type(t) for t in types):
            return func(*args, **kwargs)
        if _has_subclass(types):
            # Let DTensor & co. desugar first: this mode then sees their local ops and collectives.
            return NotImplemented
        packet = func._overloadpacket.__name__
        namespace = func.namespace
        try:
            if namespace == "aten":
                if packet in _SYNC_PACKETS and not _busy():
                    detail = _sync_detail(packet, args, kwargs)
                    if detail is not None:
                        _record(_SYNC_PACKETS[packet], str(func), detail, sync=True)
                elif packet in _SDPA_PACKETS:
                    for detail in _sdpa_violations(func, args, kwargs):
                        _record("sdpa", str(func), detail, sync=False)
                elif packet == "_grouped_mm":
                    for detail in _grouped_mm_violations(args, kwargs):
                        _record("grouped_mm", str(func), detail, sync=False)
                if packet in _MATMUL_PACKETS and not _busy():
                    _record_dtype(func, args, kwargs)
            elif namespace in ("c10d", "_c10d_functional") and packet not in _COLLECTIVE_EXEMPT:
                for detail in _collective_violations(func, args, kwargs):
                    _record("collective", str(func), detail, sync=False)
            elif namespace == "plait":
                for kind, details in _plait_op_violations(func, args, kwargs):
                    for detail in details:
                        _record(kind, str(func), detail, sync=False)
                if packet in _PLAIT_KERNELS and not _busy():
                    _record_dtype(func, args, kwargs)
        except Exception as e:  # a check must never change what the step computes
            _record("sentinel_error", str(func), f"{type(e).__name__}: {e}", sync=False)
        if namespace == "plait":
            with _suppressed():  # one kernel on a GPU: its CPU kernel's insides are not the step's
                return func(*args, **kwargs)
        return func(*args, **kwargs)
