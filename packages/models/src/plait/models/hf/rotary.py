"""RoPE's two row layouts inside each head, for the adapters whose HF models rotate halves.

plait rotates adjacent pairs (x[2i], x[2i+1]) like Meta's reference; HF's Llama and Qwen3 rotate
halves (x[i], x[i + head_dim/2]). Permuting the output rows of wq and wk within each head turns
one into the other: the attention scores are unchanged because q and k are permuted alike and the
score is a dot product over head_dim.
"""

import torch


def interleaved_to_half(w_OI: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows from pairs (0, 1), (2, 3), ... to halves (0, 2, ..., 1, 3, ...)."""
    out_dim, in_dim = w_OI.shape
    return w_OI.view(out_dim // head_dim, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w_OI: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half`."""
    out_dim, in_dim = w_OI.shape
    return w_OI.view(out_dim // head_dim, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def rotary_rows(tensor: torch.Tensor, head_dim: int, to_hf: bool) -> torch.Tensor:
    """A projection's rows (or a [head_dim] norm weight, as one row per entry) between the layouts."""
    permute = interleaved_to_half if to_hf else half_to_interleaved
    if tensor.dim() == 1:
        return permute(tensor[:, None], head_dim)[:, 0]
    return permute(tensor, head_dim)
