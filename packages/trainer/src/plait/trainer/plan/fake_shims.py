"""Where a fake step cannot run as the real one: host reads (assumed balanced) and fp32 grouped GEMMs.

Host reads. A fake tensor has no values, so a host read (`.item()`, `.tolist()`: the dropless expert-parallel
dispatch's split sizes, one read per MoE layer per forward) cannot be answered from the data. The
planner answers it with the balanced case: every ep rank sends and receives tokens x top_k / ep
rows. Real routing is uneven, so the dropless all-to-all bytes of a plan are the balanced figure
(capacity mode, `parallelism.expert_capacity_factor > 0`, has fixed sizes and is exact). Every
read is counted.

fp32 grouped GEMMs. torch's shape function for `_grouped_mm` insists on bf16 (the CUDA kernel's
rule) while the CPU kernel also takes fp32; an fp32 call gets its shape from the bf16 call, cast
back (below the memory tracker, which sees only the fp32 result, as in the real step).
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


class FakeStepShims(TorchDispatchMode):
    def __init__(self, rows_per_ep_rank: int):
        super().__init__()
        self.rows_per_ep_rank = rows_per_ep_rank
        self.reads = 0  # scalars read back (a .tolist() of n values reads n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            self.reads += 1
            if args[0].dtype.is_floating_point or args[0].dtype == torch.bool:
                raise NotImplementedError(
                    "plait-plan: the step reads a float or bool value back to the host, which a plan cannot "
                    "know; only the expert-parallel split sizes are assumed (balanced)."
                )
            return self.rows_per_ep_rank
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
            a, b, *rest = args
            return func(a.bfloat16(), b.bfloat16(), *rest, **(kwargs or {})).float()
        return func(*args, **(kwargs or {}))


def balanced_rows(config, plan) -> int:
    """tokens x top_k / ep: the rows one rank sends to (and receives from) each ep rank when
    routing is balanced."""
    t = config.training
    tokens = t.local_batch_size * t.seq_len // plan.dims.cp
    top_k = max((getattr(m, "top_k", 0) for m in plan.model.modules()), default=0) or 1
    return tokens * top_k // max(plan.dims.ep, 1)
