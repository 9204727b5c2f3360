"""The step sentinel (tests only): what would stall or break a GPU, seen on a CPU run.

`with StepSentinel() as s:` around a training step records

- host syncs: every operation that blocks the host on a GPU (`.item()`, `.tolist()`, `bool(t)`,
  `nonzero`, boolean-mask indexing, ops whose output shape depends on the data, `equal` /
  `allclose`, tensors built from Python data on the compute device, copies to the CPU);
- precondition violations: tensors handed to a kernel or collective that break what its CUDA
  implementation requires (SDPA flash / efficient / cudnn inputs with a strided last dim or a
  non-contiguous logsumexp, a causal block that is not square, `_grouped_mm` offsets / strides /
  alignment, non-contiguous collective buffers, and the inputs of plait's own kernel ops:
  `plait::document_attention` against FlashAttention-2 varlen's, `plait::grouped_mm` against
  `_grouped_mm`'s). CPU kernels honour any stride, so these pass every CPU test and break on CUDA.
  A plait op is one kernel on a GPU: what its CPU kernel does inside (reading the document offsets
  on the host) is not judged, its inputs are.

Each record names the first source line outside torch and this file. Two layers see them: on a
CPU run most syncs are no-ops that never reach the dispatcher (`.tolist()`, `.cpu()`), so the
Tensor methods and `torch.*` constructors are wrapped while a sentinel is entered (this also holds
inside autograd backward and hooks, where a TorchFunctionMode would be popped); a
TorchDispatchMode sees the aten ops (the syncs that C++ issues, kernel and collective arguments).
It lets tensor subclasses (DTensor, functional-collective tensors) run first, so it checks the
local tensors and the collectives they issue. A sync already recorded at the function layer is
not recorded again by the aten ops it runs.

Code that syncs on purpose (the dropless expert-parallel dispatch's split sizes) wraps the sync
in `plait.mesh.declared_sync("why")`: it still counts, its detail says `declared: why`.
"""

import contextlib
import os
import sys
import threading
import weakref
from collections import Counter
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.mesh.declared_sync import current_reason, declared_sync

__all__ = ["Record", "StepSentinel", "declared_sync"]


class Record(NamedTuple):
    kind: str  # e.g. "item", "tolist", "nonzero", "bool_mask_index", "python_data", "to_cpu", "sdpa", "grouped_mm"
    op: str  # the function or aten op
    where: str  # "path:line" of the first frame outside torch and this file
    detail: str

    @property
    def declared(self) -> bool:
        return self.detail.startswith("declared:")


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_STDLIB_DIR = os.path.dirname(contextlib.__file__) + os.sep
# torch frames that say nothing about who issued an op (the backward call, decorators)
_PLUMBING = ("/_dynamo/", "/autograd/", "/utils/_contextlib", "/_tensor.py", "/utils/_python_dispatch", "/_compile.py")
_local = threading.local()  # .busy: inside a recorded function
_active: list["StepSentinel"] = []  # entered sentinels (innermost last)
_patch_lock = threading.Lock()


def _stdlib(name: str) -> bool:
    return name.startswith(_STDLIB_DIR) and "-packages" not in name


def _caller() -> tuple[str, str]:
    """(first frame outside torch / this file / the stdlib, innermost torch frame or '')."""
    frame = sys._getframe(2)
    inner_torch = ""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_TORCH_DIR):
            if not inner_torch and not any(part in name for part in _PLUMBING):
                inner_torch = f"torch/{name[len(_TORCH_DIR) :]}:{frame.f_lineno}"
        elif os.path.abspath(name) != _THIS_FILE and not _stdlib(name):
            short = name.split("/src/", 1)[-1] if "/src/" in name else os.path.relpath(name)
            return f"{short}:{frame.f_lineno}", inner_torch
        frame = frame.f_back
    return "<unknown>", inner_torch


def _record(kind: str, op: str, detail: str, sync: bool) -> None:
    sentinel = _active[-1] if _active else None
    if sentinel is None or not sentinel._watching_this_thread():
        return
    where, inner = _caller()
    if inner:
        detail = f"{detail} (in {inner})" if detail else f"in {inner}"
    declared = current_reason()
    if sync and declared:
        detail = f"declared: {declared}; {detail}"
    (sentinel.host_syncs if sync else sentinel.violations).append(Record(kind, op, where, detail))


def _record_dtype(func, args, kwargs) -> None:
    for sentinel in _active:
        if sentinel.compute_dtype is not None and sentinel._watching_this_thread():
            off = _off_dtype(func._overloadpacket.__name__, args, kwargs, sentinel.compute_dtype)
            if off is not None:
                where, _ = _caller()
                sentinel.off_dtype_kernels[(func._overloadpacket.__name__, where, off)] += 1


def _busy() -> bool:
    return _local.__dict__.get("busy", 0) > 0


@contextlib.contextmanager
def _suppressed():
    _local.busy = _local.__dict__.get("busy", 0) + 1
    try:
        yield
    finally:
        _local.busy -= 1


# ---- function layer: Tensor methods and torch.* functions ------------------------------------


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _masked_fill(index, value, python_layer: bool) -> bool:
    """`t[mask] = v` with one bool mask and one host value (a Python number, a 1-element CPU
    tensor): index_put_ runs it as masked_fill_ (canDispatchToMaskedFill in
    TensorAdvancedIndexing.cpp), no nonzero, no sync. At the Python layer a tensor value must be
    known host data (on a CPU run every tensor is on the CPU); the aten layer sees Python numbers
    only as CPU tensors, so there any 1-element CPU value passes."""
    # Basic indices (ints, slices, None, ...) only take a view first; what matters is that the one
    # advanced index is the mask.
    items = index if isinstance(index, tuple) else (index,)
    advanced = [i for i in items if isinstance(i, (torch.Tensor, list))]
    if not (len(advanced) == 1 and isinstance(advanced[0], torch.Tensor) and advanced[0].dtype == torch.bool):
        return False
    if isinstance(value, (int, float, bool)):
        return True
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.device.type != "cpu":
        return False
    return _on_host_already(value) if python_layer else True


def _device_of(value) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None


def _to_cpu_target(tensor: torch.Tensor, args, kwargs, compute: torch.device) -> bool:
    """Whether `tensor.to(*args, **kwargs)` is a blocking device-to-host copy on a GPU run. On a
    CPU run every tensor is on the CPU, so only a target spelled `"cpu"` counts there (a
    `torch.device` equal to the compute device is the normal host-to-device input copy)."""
    if kwargs.get("non_blocking") or (len(args) > 1 and args[1] is True and isinstance(args[0], torch.dtype)):
        return False
    for value in [*args, kwargs.get("device")]:
        target = _device_of(value)
        if target is None or target.type != "cpu":
            continue
        if tensor.device.type != "cpu":
            return True
        return compute.type == "cpu" and isinstance(value, str)
    return False


def _compute() -> torch.device:
    return _active[-1].device if _active else torch.device("cpu")


# Tensors known to live on the host on purpose (built from Python data without the compute device,
# or copied to the CPU), by id: reading them is no sync on a GPU run either (the optimizer's step
# counter is one). id -> weakref, checked for identity (a WeakSet would compare tensors with ==).
_host_tensors: dict[int, weakref.ref] = {}


def _mark_host(tensor) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
        if len(_host_tensors) > 100_000:
            for key in [k for k, ref in _host_tensors.items() if ref() is None]:
                del _host_tensors[key]
        _host_tensors[id(tensor)] = weakref.ref(tensor)


def _on_host_already(tensor) -> bool:
    """A tensor that lives on the CPU on purpose (on a GPU run: every CPU tensor)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    ref = _host_tensors.get(id(tensor))
    return _compute().type != "cpu" or (ref is not None and ref() is tensor)


def _host_device(device, result: torch.Tensor) -> bool:
    """Whether a tensor built from Python data stays on the host. On a CPU run a device named by
    the string "cpu" (or none) means the host; a torch.device (what code passes as "the compute
    device") means the compute device."""
    if _compute().type != "cpu":
        return result.device.type == "cpu"
    return device is None or isinstance(device, str)


def _python_data(data) -> bool:
    return not isinstance(data, torch.Tensor)


def _checks():
    """name -> (kind, predicate(args, kwargs, result_or_None) -> detail or None). Predicates that
    need the result are called after the call (result passed); others before (result None)."""

    def always(kind):
        return lambda args, kwargs: f"{kind}"

    def sync_unless_host(args, kwargs):
        return None if _on_host_already(args[0]) else "device-to-host"

    def one_arg_where(args, kwargs):
        return "one-argument where" if len(args) + len(kwargs) == 1 else None

    def repeats_tensor(args, kwargs):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        output_size = kwargs.get("output_size")
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and "repeats" not in kwargs:
            repeats = args[0]  # torch.repeat_interleave(repeats)
        if isinstance(repeats, torch.Tensor) and output_size is None:
            return "repeats tensor without output_size"
        return None

    def bool_index(args, kwargs):
        if len(args) < 2 or not _is_bool_index(args[1]):
            return None
        if len(args) > 2 and _masked_fill(args[1], args[2], python_layer=True):
            return None
        return "index with a bool tensor"

    def to(args, kwargs):
        return "to cpu" if _to_cpu_target(args[0], args[1:], kwargs, _compute()) else None

    sync = {
        "item": ("item", sync_unless_host),
        "__bool__": ("item", sync_unless_host),
        "__int__": ("item", sync_unless_host),
        "__float__": ("item", sync_unless_host),
        "__index__": ("item", sync_unless_host),
        "tolist": ("tolist", sync_unless_host),
        "numpy": ("to_cpu", sync_unless_host),
        "cpu": ("to_cpu", sync_unless_host),
        "to": ("to_cpu", to),
        "nonzero": ("nonzero", always("data-dependent shape")),
        "argwhere": ("nonzero", always("data-dependent shape")),
        "where": ("nonzero", one_arg_where),
        "masked_select": ("nonzero", always("data-dependent shape")),
        "unique": ("data_dependent_shape", always("unique")),
        "unique_consecutive": ("data_dependent_shape", always("unique_consecutive")),
        "bincount": ("data_dependent_shape", always("bincount")),
        "repeat_interleave": ("data_dependent_shape", repeats_tensor),
        "equal": ("item", always("equal returns a Python bool")),
        "allclose": ("item", always("allclose returns a Python bool")),
        "__getitem__": ("bool_mask_index", bool_index),
        "__setitem__": ("bool_mask_index", bool_index),
    }
    return sync


_TENSOR_METHODS = [
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "to", "nonzero",
    "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave", "equal",
    "allclose", "__getitem__", "__setitem__",
]  # fmt: skip
_TORCH_FUNCTIONS = [
    "nonzero", "argwhere", "where", "masked_select", "unique", "unique_consecutive", "bincount",
    "repeat_interleave", "equal", "allclose",
]  # fmt: skip
_CONSTRUCTORS = ["tensor", "as_tensor", "asarray"]


def _wrap_check(name: str, original, kind: str, check):
    def wrapper(*args, **kwargs):
        if not _active or _busy():
            return original(*args, **kwargs)
        detail = check(args, kwargs)
        if detail is not None:
            _record(kind, name, detail, sync=True)
        # Judged here: the aten ops it runs (an item() of a host tensor) are not judged again.
        with _suppressed():
            result = original(*args, **kwargs)
        if kind == "to_cpu" and detail is not None:
            _mark_host(result)
        return result

    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", name)
    return wrapper


def _wrap_constructor(name: str, original):
    def wrapper(*args, **kwargs):
        if not _active or _busy():
            return original(*args, **kwargs)
        with _suppressed():
            result = original(*args, **kwargs)
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        if not _python_data(data):
            return result
        if _host_device(kwargs.get("device"), result):
            _mark_host(result)
        else:
            _record("python_data", f"torch.{name}", f"host-to-device copy of Python data to {result.device}", True)
        return result

    wrapper.__wrapped__ = original
    return wrapper


def _wrap_new_tensor(original):
    def wrapper(self, data, *args, **kwargs):
        result = original(self, data, *args, **kwargs)
        if _active and not _busy() and _python_data(data) and not _on_host_already(self):
            _record("python_data", "Tensor.new_tensor", f"host-to-device copy of Python data to {result.device}", True)
        return result

    wrapper.__wrapped__ = original
    return wrapper


_patches: list[tuple[object, str, object]] = []  # (owner, name, original) while installed


def _install() -> None:
    checks = _checks()
    for name in _TENSOR_METHODS:
        kind, check = checks[name]
        original = getattr(torch.Tensor, name)
        _patches.append((torch.Tensor, name, original))
        setattr(torch.Tensor, name, _wrap_check(f"Tensor.{name}", original, kind, check))
    for name in _TORCH_FUNCTIONS:
        kind, check = checks[name]
        original = getattr(torch, name)
        _patches.append((torch, name, original))
        setattr(torch, name, _wrap_check(f"torch.{name}", original, kind, check))
    for name in _CONSTRUCTORS:
        original = getattr(torch, name)
        _patches.append((torch, name, original))
        setattr(torch, name, _wrap_constructor(name, original))
    _patches.append((torch.Tensor, "new_tensor", torch.Tensor.new_tensor))
    torch.Tensor.new_tensor = _wrap_new_tensor(torch.Tensor.new_tensor)


def _uninstall() -> None:
    while _patches:
        owner, name, original = _patches.pop()
        setattr(owner, name, original)


# ---- aten layer: syncs issued below Python, kernel and collective preconditions ----------------

_aten = torch.ops.aten
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
_SDPA_PACKETS = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
}
# The flash / efficient / cudnn CUDA kernels need a unit stride in the head dim of q, k and v
# (flash_api.cpp: "Input tensor must have contiguous last dimension"). Their backward wrappers
# make grad_out and out contiguous themselves (attention_backward.cu: "CUDA code assumes that
# dout is contiguous") but hand logsumexp on as it is, read as a dense [B, H, S] buffer: a strided
# slice gives silently wrong gradients (torch's ring attention calls .contiguous() on it for this).
_SDPA_LAST_DIM = {"query", "key", "value"}
_SDPA_DENSE = {"logsumexp"}
# Functional all_reduce clones its input contiguous itself; wait_tensor only waits.
_COLLECTIVE_EXEMPT = {"wait_tensor", "all_reduce", "all_reduce_coalesced"}
# The compute kernels of a step: in a bf16 step, one of these in another dtype is a dtype-only bug
# (an fp32 expert GEMM found this way looked right in every loss comparison).
_MATMUL_PACKETS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", *_SDPA_PACKETS}
# plait's kernel ops (namespace plait), whose data inputs must be in the step's compute dtype too.
_PLAIT_KERNELS = {"grouped_mm", "document_attention", "document_attention_backward"}


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


def _tensors_of(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_of(v)


def _named_args(func, args, kwargs):
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            yield arg.name, args[i]
        elif arg.name in kwargs:
            yield arg.name, kwargs[arg.name]


def _dense_lse(func, lse: torch.Tensor) -> bool:
    if lse.is_contiguous():
        return True
    # The CPU flash forward writes logsumexp as [B, S, H] and returns it transposed: that layout is
    # its own; what it stands for on CUDA (a dense buffer, no slice) is what must hold.
    cpu_op = "for_cpu" in func._overloadpacket.__name__
    return cpu_op and lse.dim() == 3 and lse.transpose(1, 2).is_contiguous()


def _sdpa_violations(func, args, kwargs):
    named = dict(_named_args(func, args, kwargs))
    query, key = named.get("query"), named.get("key")
    if named.get("is_causal") and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
        if query.dim() == 4 and query.shape[-2] != key.shape[-2]:
            # FA2 aligns a causal mask bottom-right when the lengths differ, the CPU kernel top-left:
            # only a square block means the same on both.
            yield f"causal block of {query.shape[-2]} queries x {key.shape[-2]} keys: not square"
    for name, value in _named_args(func, args, kwargs):
        if not isinstance(value, torch.Tensor):
            continue
        if name in _SDPA_LAST_DIM and value.dim() > 0 and value.stride(-1) != 1 and value.size(-1) > 1:
            yield f"{name} stride(-1) = {value.stride(-1)}, the CUDA kernel needs 1 (strides {tuple(value.stride())})"
        if name in _SDPA_DENSE and not _dense_lse(func, value):
            yield f"{name} not contiguous (shape {tuple(value.shape)}, strides {tuple(value.stride())}): read as dense"


def _grouped_mm_mat(name: str, mat: torch.Tensor):
    """aten/src/ATen/native/GroupedMMUtils.h check_valid_strides_and_return_transposed."""
    if mat.data_ptr() % 16:
        yield f"{name} data pointer not 16-byte aligned (storage offset {mat.storage_offset()})"
    strides, sizes, size = mat.stride(), mat.shape, mat.element_size()
    alignment = 16 // size
    if strides[-2] == 1 and strides[-1] >= max(1, sizes[-2]):
        if strides[-1] % alignment:
            yield f"{name} stride {strides[-1]} not a multiple of 16 bytes"
    elif strides[-1] == 1 and strides[-2] >= max(1, sizes[-1]):
        if strides[-2] % alignment:
            yield f"{name} stride {strides[-2]} not a multiple of 16 bytes"
    else:
        yield f"{name} strides {tuple(strides)} for sizes {tuple(sizes)}: neither of the last two dims has stride 1"


def _grouped_mm_groups(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor):
    """GroupMMCommon.cuh: TMA needs every group's start address 16-byte aligned, so for each group
    but the last, (group size x byte stride along the grouped dim) % 16 == 0 for each tensor whose
    address advances along it. Read only where offs is host memory (a CPU run): no sync."""
    size = mat_a.element_size()
    if mat_a.dim() == 2 and mat_b.dim() == 3:  # rows of a (and of the output) are grouped
        advancing = {"mat_a": mat_a.stride(0), "out": mat_b.size(-1)}
    elif mat_a.dim() == 3 and mat_b.dim() == 2:  # columns of b (and of the output)
        advancing = {"mat_b": mat_b.stride(1), "out": 1}
    elif mat_a.dim() == 2 and mat_b.dim() == 2:  # the contraction dim (weight gradients)
        advancing = {"mat_a": mat_a.stride(1), "mat_b": mat_b.stride(0)}
    else:
        return
    with _suppressed():
        ends = offs.tolist()
    bounds = [0, *ends]
    for g in range(len(ends) - 1):  # the last group's end is the tensor's end
        start, end = bounds[g], bounds[g + 1]
        for name, stride in advancing.items():
            if ((end - start) * stride * size) % 16:
                yield f"group {g} has {end - start} rows: {name} group start not 16-byte aligned (offs {ends})"
                return


def _grouped_mm_violations(args, kwargs):
    mat_a, mat_b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    yield from _grouped_mm_mat("mat_a", mat_a)
    yield from _grouped_mm_mat("mat_b", mat_b)
    if mat_a.dtype != mat_b.dtype:
        yield f"mat_a {mat_a.dtype} and mat_b {mat_b.dtype} differ"
    if offs is not None and offs.device.type == "cpu" and offs.dim() == 1:
        yield from _grouped_mm_groups(mat_a, mat_b, offs)
    if offs is not None:
        if offs.dtype != torch.int32:
            yield f"offs dtype {offs.dtype}, the CUDA kernel needs torch.int32"
        if offs.dim() != 1 or not offs.is_contiguous():
            yield f"offs must be 1-D and contiguous (shape {tuple(offs.shape)}, strides {tuple(offs.stride())})"


# FlashAttention-2 varlen (flash_api.cpp mha_varlen_fwd / mha_varlen_bwd): int32 contiguous
# cu_seqlens on the device, one head dim for q and k that is a multiple of 8 and at most 256 (v is
# padded to it by the op), a unit stride in the head dim, heads a multiple of the kv heads.
_VARLEN_MAX_HEAD_DIM = 256


def _document_attention_violations(func, args, kwargs):
    named = dict(_named_args(func, args, kwargs))
    q, k, v, cu = (named.get(n) for n in ("q", "k", "v", "cu_seqlens"))
    if cu.dtype != torch.int32:
        yield f"cu_seqlens dtype {cu.dtype}, FlashAttention-2 varlen needs torch.int32"
    if cu.dim() != 1 or not cu.is_contiguous():
        yield f"cu_seqlens must be 1-D and contiguous (shape {tuple(cu.shape)}, strides {tuple(cu.stride())})"
    if cu.device != q.device:
        yield f"cu_seqlens on {cu.device}, q on {q.device}: the kernel reads it on q's device"
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        yield f"q head dim {head_dim} != k head dim {k.shape[-1]}"
    if head_dim % 8 or head_dim > _VARLEN_MAX_HEAD_DIM:
        yield f"head dim {head_dim}: varlen needs a multiple of 8, at most {_VARLEN_MAX_HEAD_DIM} (else one call per document)"
    if v.shape[-1] > head_dim:
        yield f"v head dim {v.shape[-1]} > q head dim {head_dim}: only narrower values are padded"
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        yield f"heads q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]}: q's must be a multiple of k's, k's = v's"
    for name in ("q", "k", "v"):
        t = named[name]
        if t.stride(-1) != 1:
            yield f"{name} stride(-1) = {t.stride(-1)}, the CUDA kernel needs 1"
        if t.dtype != q.dtype:
            yield f"{name} dtype {t.dtype}, q has {q.dtype}"


def _plait_op_violations(func, args, kwargs):
    packet = func._overloadpacket.__name__
    if packet in ("document_attention", "document_attention_backward"):
        yield "document_attention", _document_attention_violations(func, args, kwargs)
    elif packet == "grouped_mm":
        yield "grouped_mm", _grouped_mm_violations(args, kwargs)


def _collective_violations(func, args, kwargs):
    for name, value in _named_args(func, args, kwargs):
        for t in _tensors_of(value):
            if not t.is_contiguous():
                yield f"{name} not contiguous (shape {tuple(t.shape)}, strides {tuple(t.stride())})"


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


# ---- the sentinel ---------------------------------------------------------------------------


class StepSentinel:
    """Records host syncs and CUDA precondition violations; enter it once per step.

    `device`: the compute device (default: cuda when available, else cpu). Records accumulate
    over every entry; `step_counts()` gives (host_syncs, violations) per entry.
    """

    def __init__(self, device: torch.device | str | None = None, compute_dtype: torch.dtype | None = None):
        # compute_dtype (e.g. bf16): count compute kernels (matmuls, grouped_mm, SDPA) whose inputs
        # are in another dtype, in `off_dtype_kernels` {(op, where, dtypes): count}; not a
        # precondition violation (fp32 on purpose exists), the caller judges.
        self.compute_dtype = compute_dtype
        self.off_dtype_kernels: Counter = Counter()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.host_syncs: list[Record] = []
        self.violations: list[Record] = []
        self._steps: list[tuple[int, int]] = []
        self._start: tuple[int, int] | None = None
        self._mode: _AtenMode | None = None
        self._thread: int | None = None

    def _watching_this_thread(self) -> bool:
        # The entering thread, and the autograd engine's own threads (a GPU backward runs there);
        # not other Python threads (a data prefetcher).
        current = threading.current_thread()
        return current.ident == self._thread or isinstance(current, threading._DummyThread)

    def __enter__(self) -> "StepSentinel":
        if self._start is not None:
            raise RuntimeError("StepSentinel is already entered; enter it once per step, not nested.")
        self._start = (len(self.host_syncs), len(self.violations))
        self._thread = threading.get_ident()
        with _patch_lock:
            if not _active:
                _install()
            _active.append(self)
        self._mode = _AtenMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
        with _patch_lock:
            _active.remove(self)
            if not _active:
                _uninstall()
        syncs, violations = self._start
        self._steps.append((len(self.host_syncs) - syncs, len(self.violations) - violations))
        self._start = None

    @staticmethod
    @contextlib.contextmanager
    def paused():
        """Record nothing of this thread inside (a test's own instrumentation within a step)."""
        with _suppressed():
            yield

    def step_counts(self) -> list[tuple[int, int]]:
        """(host syncs, precondition violations) for each entered step, in order."""
        return list(self._steps)

    def report(self) -> str:
        """Short text: counts grouped by (kind, where), syncs then violations."""
        lines = [f"{len(self._steps)} steps, {len(self.host_syncs)} host syncs, {len(self.violations)} violations"]
        for title, records in (("host syncs", self.host_syncs), ("precondition violations", self.violations)):
            if not records:
                continue
            lines.append(f"{title}:")
            groups = Counter((r.kind, r.where) for r in records)
            example = {}
            for r in records:
                example.setdefault((r.kind, r.where), r)
            for (kind, where), n in groups.most_common():
                r = example[(kind, where)]
                lines.append(f"  {n:5d} x {kind:<20} {where}  {r.op}: {r.detail}")
        return "\n".join(lines)
