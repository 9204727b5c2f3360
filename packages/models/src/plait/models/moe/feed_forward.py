"""SwiGLU feed-forward: the dense FFN of DeepSeek's first layers and the MoE shared experts."""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """`w2(silu(w1(x)) * w3(x))` with bias-free Linears named as the tensor-parallel plan expects."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        # w1 feeds the gate nonlinearity; w2/w3 write into the residual stream, so they get the
        # depth-scaled std (torchtitan's convention).
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=init_std)
