"""Reference attention for the context-parallel tests: full causal attention in fp64 on one process."""

import torch
import torch.nn.functional as F


def reference_attention(q, k, v, scale=None):
    """Causal attention (GQA by repeating kv heads) in fp64, autograd-enabled."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q.double(), k64, v64, is_causal=True, scale=scale)


def random_qkv(B, H, G, S, dqk, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, dqk, generator=g).to(dtype)
    k = torch.randn(B, G, S, dqk, generator=g).to(dtype)
    v = torch.randn(B, G, S, dv, generator=g).to(dtype)
    dout = torch.randn(B, H, S, dv, generator=g).to(dtype)
    return q, k, v, dout


def reference_with_grads(q, k, v, dout, scale=None):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, scale)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad
