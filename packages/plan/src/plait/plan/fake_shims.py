"""Where a fake step cannot run as the real one: host reads (assumed balanced) and fp32 grouped GEMMs.

Host reads. A fake tensor has no values, so a host read (`.item()`, `.tolist()`: the dropless expert-parallel
dispatch's split sizes, one read per MoE layer per forward) cannot be answered from the data. The
planner answers it with the balanced case: the dispatched rows split evenly over the ep ranks,
both ways. Real routing is uneven, so the dropless all-to-all bytes of a plan are the balanced figure
(capacity mode, `parallelism.expert_capacity_factor > 0`, has fixed sizes and is exact). Every
read is counted. While the model is initialised, a bool read (the truncated normal's "any value
out of range?") answers no.

fp32 grouped GEMMs. torch's shape function for `_grouped_mm` insists on bf16 (the CUDA kernel's
rule) while the CPU kernel also takes fp32; an fp32 call gets its shape from the bf16 call, cast
back (below the memory tracker, which sees only the fp32 result, as in the real step).

Real tensors. An op whose tensors are all real (a DeviceMesh made while the model is sharded, the
micro-batch's own bookkeeping) runs for real instead of turning them fake.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class FakeStepShims(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.answers: list[int] = []  # the values the next host reads return, in order
        self.reads = 0  # scalars read back (a .tolist() of n values reads n)
        self.initialising = False  # set while the model is built and initialised

    def balance(self, dispatcher) -> None:
        """Answer `dispatcher`'s split-size read (counts_RE.sum(1), received_RE.sum(1) of the rows
        it is given) with balanced routing: the rows split as evenly as they go over the ep ranks."""
        dispatch = dispatcher.dispatch

        def balanced_dispatch(x_ND, num_tokens_per_expert_E, *args, **kwargs):
            rows, ep = x_ND.shape[0], dispatcher.ep
            even = [rows // ep + (1 if i < rows % ep else 0) for i in range(ep)]
            self.answers = even + even
            return dispatch(x_ND, num_tokens_per_expert_E, *args, **kwargs)

        dispatcher.dispatch = balanced_dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first: its local op comes back here
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            if self.initialising:
                # init_weights' truncated normal redraws while any value is out of range: none is.
                # (Its bounds are constants, which the fake tensor knows.)
                return False if args[0].dtype == torch.bool else func(*args, **(kwargs or {}))
            self.reads += 1
            if not self.answers:
                raise NotImplementedError(
                    "plait-plan: the step reads a value back to the host that a plan cannot know; only the "
                    "expert-parallel dispatch's split sizes are assumed (balanced)."
                )
            return self.answers.pop(0)
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
            a, b, *rest = args
            return func(a.bfloat16(), b.bfloat16(), *rest, **(kwargs or {})).float()
        if _all_real(args, kwargs):
            # Host bookkeeping on real tensors (a DeviceMesh's rank coordinates, the micro-batch's
            # token count) runs for real: it may read its values, and it is small.
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _all_real(args, kwargs) -> bool:
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)
