"""Bring your own model: an attention layer plait did not write, under ContextParallelSDPA.

`UserAttention` is what a user's model looks like: projections, RoPE indexed by positions, and a
call to F.scaled_dot_product_attention (causal, GQA, its own scale) -- no `sdpa` submodule. It runs
under context parallel three ways: F.scaled_dot_product_attention patched for the step, the
function passed in, and transformers' attention-interface signature (called as transformers calls
it, without importing transformers). Each rank compares its output rows and the all-reduced
parameter gradients with the same layer on the full sequence in one process.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait.contextparallel import ContextParallelConfig, ContextParallelSDPA, shard_batch, shard_sequence

MODES = ("patch", "passed", "transformers")


def rope(x_BSHA: torch.Tensor, positions_S: torch.Tensor) -> torch.Tensor:
    half = x_BSHA.shape[-1] // 2
    angle_SA = positions_S[:, None].float() * (1e-2 ** (torch.arange(half) / half))[None]
    cos, sin = angle_SA.cos()[None, :, None], angle_SA.sin()[None, :, None]
    x1, x2 = x_BSHA[..., :half], x_BSHA[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class UserAttention(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, mode="patch", attention=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim)
        self.wo = nn.Linear(dim, dim)
        self.mode, self.attention, self.is_causal = mode, attention, True

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = rope(self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim), positions_S).transpose(1, 2)
        k = rope(self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim), positions_S).transpose(1, 2)
        v = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.mode == "transformers":  # (module, q, k, v, mask, scaling=, dropout=, **kwargs) -> [B, S, H, A]
            out_BSHA, _ = self.attention(self, q, k, v, None, scaling=0.3, dropout=0.0, position_ids=positions_S)
        else:  # "patch" looks F.scaled_dot_product_attention up at call time, as user code does
            attend = self.attention if self.mode == "passed" else F.scaled_dot_product_attention
            out_BSHA = attend(q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
        return self.wo(out_BSHA.reshape(B, S, -1))


def byom_errors(rank: int, cp_mesh) -> dict:
    """Max abs error (output rows, parameter gradients) per (method, mode) on this rank."""
    errors = {}
    B, S, D = 2, 8 * cp_mesh.size(), 32
    g = torch.Generator().manual_seed(7)
    x_BSD, target_BSD = torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)
    torch.manual_seed(0)
    reference = UserAttention()
    out_ref = reference(x_BSD, torch.arange(S))
    (out_ref * target_BSD).sum().backward()
    for method in ("allgather", "ring", "ulysses"):
        cp_sdpa = ContextParallelSDPA(cp_mesh, ContextParallelConfig(method))
        layout = cp_sdpa.layout
        # The user's batch through shard_batch: this rank's tokens and their positions (RoPE).
        x, target, positions = shard_batch(x_BSD, target_BSD, rank, layout)
        for mode in MODES:
            attention = cp_sdpa.transformers_attention if mode == "transformers" else cp_sdpa
            model = UserAttention(mode=mode, attention=attention)
            model.load_state_dict(reference.state_dict())
            with cp_sdpa.patch() if mode == "patch" else contextlib.nullcontext():
                out = model(x, positions)
                (out * target).sum().backward()
            assert F.scaled_dot_product_attention is not cp_sdpa  # patch() restored it
            errs = [(out - shard_sequence(out_ref, 1, rank, layout)).abs().max().item()]
            for p, p_ref in zip(model.parameters(), reference.parameters()):
                dist.all_reduce(p.grad, group=cp_mesh.get_group())  # each rank holds its tokens' share
                errs.append((p.grad - p_ref.grad).abs().max().item())
            errors[("byom", method, mode)] = errs
    return errors
