"""`plait::grouped_mm`: torch's grouped GEMM as a custom op that torch.compile traces in any dtype.

torch's fake-tensor rule for `torch._grouped_mm` (`_meta_grouped_mm_common`) admits bf16 only,
the CUDA kernel's dtype; the CPU kernel also runs fp32, which therefore could not enter a graph
and split every compiled MoE block. This op runs the same kernel and states the output shape for
any dtype, and its backward is two calls of itself, so the backward traces too.

The two layouts the experts and their gradients need, `offs` int32 cumulative group ends:
    a [M, K] x b [G, K, N] -> [M, N]     rows offs[g-1]:offs[g] of a times b[g]
    a [K, M] x b [M, N]    -> [G, K, N]  columns / rows offs[g-1]:offs[g] of a and b, per group
Rows past offs[-1] are left undefined (the kernel's contract; callers mask them with `where`).

bf16 on a CPU that emulates it (plait.models.cpu_bf16) runs torch's kernel in fp32 on the bf16
operands and rounds the result once: 4.3x faster there, the operands saved for backward stay bf16.
"""

import torch

from plait.models.cpu_bf16 import cpu_multiplies_in_fp32


@torch.library.custom_op("plait::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if cpu_multiplies_in_fp32(a.dtype, a.device) and b.dtype == a.dtype:
        return torch._grouped_mm(a.float(), b.float(), offs=offs).to(a.dtype)
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a, b, offs):
    # torch's meta rule minus its dtype check (torch/_meta_registrations.py
    # `_create_grouped_mm_output_tensor`): contiguous rows, as the CPU kernel returns.
    if b.dim() == 3:
        torch._check(offs.size(0) == b.size(0), lambda: "grouped_mm: one offset per group of b")
        return a.new_empty(a.size(0), b.size(-1))
    return a.new_empty(offs.size(0), a.size(0), b.size(1))


def _setup_context(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    if b.dim() != 3:
        raise NotImplementedError("plait::grouped_mm: backward of the 2D x 2D layout is not needed by the experts")
    grad_a = grad_b = None
    grad = grad.contiguous()  # the kernel takes row- or column-major operands, not expanded ones
    # What torch's own derivative of _grouped_mm computes for 2D x 3D (derivatives.yaml,
    # `_grouped_mm_mat1_backward` / `_grouped_mm_mat2_backward`): the group structure of the rows
    # is shared, so grad_a is one more 2D x 3D call and grad_b a 2D x 2D call over the same offs.
    if ctx.needs_input_grad[0]:
        grad_a = grouped_mm(grad, b.transpose(-2, -1), offs)  # [M, N] x [G, N, K] -> [M, K]
    if ctx.needs_input_grad[1]:
        grad_b = grouped_mm(a.t(), grad, offs)  # per group a_g^T @ grad_g: [K, M] x [M, N] -> [G, K, N]
    return grad_a, grad_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
