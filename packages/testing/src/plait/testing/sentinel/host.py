"""What lives on the host on purpose: the compute device of the entered sentinel, tensors known to be
host data (reading them is no sync), and bool-mask assignments that run as masked_fill (no sync)."""

import weakref

import torch

from .records import _active


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
