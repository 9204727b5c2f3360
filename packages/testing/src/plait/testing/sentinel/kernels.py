"""CUDA kernel and collective preconditions: what the CUDA implementation of SDPA, `_grouped_mm`,
plait's kernel ops and the c10d collectives requires of their inputs, which the CPU kernels do not."""

import torch

from .records import _suppressed

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
