"""AdamW with its two moments stored in bf16 (optimizer.state_dtype = bf16): 12 bytes of model
state per parameter instead of 16 (fp32 weight 4 + fp32 gradient 4 + two bf16 moments 2 + 2).

Each step reads the moments into fp32, does torch AdamW's arithmetic in fp32 (the same formula:
decoupled decay, lerp of the first moment, bias corrections), updates the fp32 weight with the
unrounded moments, and stores the moments back in bf16 by stochastic rounding whose random bits
are a hash of each element's place in the whole parameter (stochastic_round.py), so every layout
rounds every element alike and FSDP / EP / TP runs equal one rank's.

It works per parameter, on the local shard (DTensors of any mesh: FSDP's, the experts' efsdp /
ep mesh, TP's), in pieces of at most CHUNK elements along dim 0 (whole rows): the fp32 copies of the moments
and the hash's integers are temporaries the size of one piece, not of the model (a foreach pass
over all parameters would hold fp32 copies of every moment at once, 8 bytes per parameter on top,
and the integer hash has no foreach ops).
"""

import math

import torch
from torch.distributed.tensor import DTensor

from .stochastic_round import global_index, key_of, local_box, random_bits, round_to_bf16

# Elements per piece. On a CPU the ~40 passes over a piece run from cache when a piece's fp32
# temporaries fit it (512 KB each: 3.5x faster than 16 MB pieces, measured on 4M elements); on a GPU
# each pass is a kernel launch, so pieces are large (~100 MB of temporaries).
CHUNK = {"cpu": 2**17}
GPU_CHUNK = 2**22
MOMENTS = ("exp_avg", "exp_avg_sq")
# What this optimizer is in torch AdamW's terms (its kernel flags name no torch kernel: None).
TORCH_ADAMW_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                         fused=None, decoupled_weight_decay=True)  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamWBF16(torch.optim.Optimizer):
    """torch.optim.AdamW's update with bf16 moments; `names` (parameter -> its FQN) and `seed`
    key the rounding."""

    def __init__(self, named_params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 seed: int) -> None:  # fmt: skip
        named_params = list(named_params)
        # torch AdamW's group keys too: a checkpoint of either loads into the other (DCP loads the
        # keys of the live optimizer's groups and refuses a missing one).
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **TORCH_ADAMW_FLAGS)
        super().__init__([p for _, p in named_params], defaults)
        self.names = {id(p): name for name, p in named_params}
        self.seed = seed
        self.host_steps: dict[int, int] = {}  # id(parameter) -> its step count
        # id(parameter) -> stochastic_round.local_box: fixed for the run, computed here, outside the
        # step (torch computes a shard's offset from index tensors it reads back).
        self.boxes = {id(p): local_box(p) for _, p in named_params}
        self.register_load_state_dict_post_hook(_after_load)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # The step count as torch's AdamW keeps it (a host tensor: what checkpoints
                    # hold), and as a Python int that the step reads (no read of a tensor:
                    # none under the planner's fake tensors, no sync on a GPU).
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    self.host_steps[id(p)] = 0
                    for moment in MOMENTS:
                        state[moment] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                state["step"] += 1
                self.host_steps[id(p)] += 1
                self._update(p, state, self.host_steps[id(p)], group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, step: int, group: dict) -> None:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        box = self.boxes[id(p)]
        key = key_of(self.seed, step, self.names.get(id(p), ""))
        tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
        if p.dim() == 0:
            tensors, box = [t.view(1) for t in tensors], ((1,), (0,), (1,))
        param, grad, exp_avg, exp_avg_sq = tensors
        rows = param.shape[0]
        chunk = CHUNK.get(param.device.type, GPU_CHUNK)
        per_piece = max(1, chunk // max(1, param[0].numel())) if rows else 1
        for start in range(0, rows, per_piece):
            piece = slice(start, min(rows, start + per_piece))
            p_, g_ = param[piece], grad[piece].float()
            p_.mul_(1 - lr * decay)
            m_fp32 = exp_avg[piece].float().lerp_(g_, 1 - beta1)
            v_fp32 = exp_avg_sq[piece].float().mul_(beta2).addcmul_(g_, g_, value=1 - beta2)
            denom = (v_fp32.sqrt() / bias_correction2_sqrt).add_(eps)
            p_.addcdiv_(m_fp32, denom, value=-step_size)
            bits_m, bits_v = random_bits(global_index(box, piece, param.device), key)
            round_to_bf16(m_fp32, bits_m, out=exp_avg[piece])
            round_to_bf16(v_fp32, bits_v, out=exp_avg_sq[piece])


def _after_load(optimizer: AdamWBF16) -> None:
    """torch's load_state_dict casts every floating state to its parameter's dtype (fp32): the
    loaded moments go back to bf16 (exact: they were bf16 values; a checkpoint with fp32 moments
    is rounded to nearest here, once). The step counts are read once, here, into host_steps."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            optimizer.host_steps[id(p)] = int(state["step"].item())
            for moment in MOMENTS:
                if state[moment].dtype != torch.bfloat16:
                    state[moment] = state[moment].to(torch.bfloat16)
