"""The function layer: Tensor methods and `torch.*` functions, wrapped while a sentinel is entered.

On a CPU run most syncs are no-ops that never reach the dispatcher (`.tolist()`, `.cpu()`), so they
are judged here (this also holds inside autograd backward and hooks, where a TorchFunctionMode
would be popped). A sync recorded here is not recorded again by the aten ops it runs.
"""

import torch

from .host import _compute, _is_bool_index, _mark_host, _masked_fill, _on_host_already
from .records import _active, _busy, _record, _suppressed


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
