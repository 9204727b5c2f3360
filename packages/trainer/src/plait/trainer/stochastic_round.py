"""Stochastic rounding of fp32 to bf16 whose random bits do not depend on the layout.

Rounding a value to bf16 by `.to(torch.bfloat16)` rounds to nearest: an optimizer moment that
moves by less than half a bf16 step per update (beta2 = 0.95 moves v by 5 % of the gradient's
square a step; the 8-bit mantissa resolves 0.4 %, so smaller moves vanish) never moves at all.
Stochastic rounding rounds up with the probability of the discarded fraction, so the stored value
is right on average.

The random bits must not come from a per-rank generator: FSDP 2 would draw other bits for a
parameter's second half than one rank draws for the same elements, and no layout would equal one
rank any more (the parity matrix). Here the 16 bits an element rounds with are a counter-based
hash of (the element's index in the whole parameter, a key made of job.seed, the step, the
parameter's name and which moment): the same element gets the same bits on any layout. A shard's
place in the whole parameter is what DCP records for it in a checkpoint
(`compute_local_shape_and_global_offset`: a box of the global tensor per rank), so the index holds
for every layout DCP can save (FSDP, HSDP, TP, EP, their combinations and pipeline stages).

The hash runs on int32 tensors (int64 ones are ~8x slower on a CPU) with the two's-complement
wrap-around that CPU and CUDA integer kernels have (the tests check the bits against a Python
model of the hash); a right shift is made logical by a mask.
"""

import math
import zlib

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

MASK32 = 0xFFFFFFFF
INT32_MAX = 2**31 - 1
# MurmurHash3's 32-bit finalizer (fmix32): its two odd multipliers, as int32 bit patterns.
FMIX_MULTIPLIERS = (0x85EBCA6B - 2**32, 0xC2B2AE35 - 2**32)


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset, global shape) of the part of `param` this rank holds."""
    if isinstance(param, DTensor):
        # Plain integers, from index tensors torch builds on the CPU: real ones under the
        # planner's fake tensors too (a fake one could not be read).
        with unset_fake_temporarily():
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(shape), tuple(offset), tuple(param.shape)
    return tuple(param.shape), (0,) * param.dim(), tuple(param.shape)


def global_index(box, rows: slice, device: torch.device) -> torch.Tensor:
    """The row-major index in the whole parameter of each local element in dim-0 `rows`: int32
    (int64 for a parameter of more than 2**31 - 1 elements: a 671B model's expert weights)."""
    shape, offset, global_shape = box
    dtype = torch.int32 if math.prod(global_shape) <= INT32_MAX else torch.int64
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    if tuple(shape[1:]) == tuple(global_shape[1:]):  # whole rows (one process, FSDP, EP): one arange
        first = (offset[0] + rows.start) * strides[0]
        return torch.arange(first, first + (rows.stop - rows.start) * strides[0], dtype=dtype, device=device).view(
            [-1, *shape[1:]]
        )
    index = torch.zeros((), dtype=dtype, device=device)
    for d, (size, start, stride) in enumerate(zip(shape, offset, strides)):
        lo, hi = (rows.start, rows.stop) if d == 0 else (0, size)
        coords = torch.arange(start + lo, start + hi, dtype=dtype, device=device) * stride
        index = index + coords.view([-1] + [1] * (len(shape) - d - 1))
    return index


def _signed32(value: int) -> int:
    value &= MASK32
    return value - 2**32 if value > INT32_MAX else value


def _shift_right(h: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (torch's >> is arithmetic: it copies the sign)."""
    return (h >> bits).bitwise_and_((1 << (32 - bits)) - 1)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix32 on int32 bit patterns, in place on `h` (a temporary of the caller's):
    a full avalanche of 32 bits."""
    h ^= _shift_right(h, 16)
    h *= FMIX_MULTIPLIERS[0]  # wraps mod 2**32
    h ^= _shift_right(h, 13)
    h *= FMIX_MULTIPLIERS[1]
    h ^= _shift_right(h, 16)
    return h


def key_of(seed: int, step: int, name: str) -> int:
    """The 32-bit key of one parameter at one step (Python ints: no tensor, no sync)."""
    return _signed32(zlib.crc32(f"{seed}:{step}:{name}".encode()))


def random_bits(index: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 16-bit draws (int32 in [0, 2**16)) per element of `index`, a function of
    (index, key) alone: one 32-bit hash, its halves. An int64 index mixes its high word in too."""
    if index.dtype == torch.int64:
        h = _mix((index & MASK32).to(torch.int32) ^ key)
        h = _mix(h ^ (index >> 32).to(torch.int32))
    else:
        h = _mix(index ^ key)
    low = h & 0xFFFF
    return low, h.bitwise_right_shift_(16).bitwise_and_(0xFFFF)


def round_to_bf16(x_fp32: torch.Tensor, bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to bf16, up (away from zero) with probability (discarded 16 bits) / 2**16; into
    `out` (bf16, x's shape) when given.

    bf16 is fp32's top 16 bits: truncate, and add one unit in the last place when the random bits
    fall below the discarded ones. Unbiased: E[result] = x (for finite x below bf16's largest)."""
    as_int = x_fp32.view(torch.int32)
    up = bits < (as_int & 0xFFFF)
    rounded = (as_int >> 16).add_(up)  # arithmetic shift: the sign stays, |value| rounds towards zero
    if out is None:
        return rounded.to(torch.int16).view(torch.bfloat16)
    out.view(torch.int16).copy_(rounded)  # the low 16 bits: the bf16 pattern
    return out
