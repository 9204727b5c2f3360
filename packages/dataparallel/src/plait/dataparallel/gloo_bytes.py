"""FSDP's all-gather on gloo for dtypes gloo does not know (float8): the same bytes, as uint8.

Float8 training (torchao, tensorwise) all-gathers the float8 weights themselves, half the bytes of
bf16. NCCL gathers float8 tensors; gloo raises "Invalid scalar type" for them. An all-gather only
concatenates every rank's bytes, so gathering the uint8 view of the same buffers is the same
collective with the same result; every other dtype goes to gloo unchanged.
"""

import torch
import torch.distributed as dist

# Not re-exported by torch.distributed.fsdp; set_custom_all_gather (public) takes one.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

# torch 2.13 renamed it (the old name warns on every call); the GPU machines' 2.11 has only the old one.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
GLOO_LACKS = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


class ByteAllGather(AllGather):
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if output_tensor.dtype in GLOO_LACKS:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return _all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)
