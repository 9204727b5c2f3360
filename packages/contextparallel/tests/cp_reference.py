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


def positions_from_lengths(lengths, first_offset=0):
    """A row's document_positions (int32) from its segment lengths; the first segment continues a
    document already `first_offset` tokens in (a row that starts mid-document)."""
    parts = [torch.arange(n, dtype=torch.int32) + (first_offset if i == 0 else 0) for i, n in enumerate(lengths)]
    return torch.cat(parts)


def packed_rows(chunk, cp):
    """The defining test's B=2 rows of S = 2 cp chunk tokens (chunk >= 4): row 0 starts mid-document
    and holds a 1-token document, one of exactly a chunk (chunk-aligned) and one longer than a rank's
    share (2 chunks); row 1 is segmented differently (an unaligned chunk-long document, 1-token ones).
    Returns (document_positions_BS, segment lengths per row)."""
    S = 2 * cp * chunk
    row0 = [chunk - 1, 1, chunk, 2 * chunk + 1, 1]
    row1 = [1, chunk, 2 * chunk + 3, 1, 1]
    rows = []
    for lengths in (row0, row1):
        cut, total = [], 0
        for n in [*lengths, S]:  # the rest of the row is one more document; cut at the row end
            n = min(n, S - total)
            if n == 0:
                break
            cut.append(n)
            total += n
        rows.append(cut)
    positions = torch.stack([positions_from_lengths(rows[0], first_offset=3), positions_from_lengths(rows[1])])
    return positions, rows


def document_reference_with_grads(q, k, v, dout, segment_lengths, scale=None):
    """Each document alone through plain causal F.scaled_dot_product_attention (fp64, kv heads
    repeated), concatenated: out and q/k/v gradients of the packed rows under document masking."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b, lengths in enumerate(segment_lengths):
        pieces, s = [], 0
        for n in lengths:
            sl = slice(s, s + n)
            qd = q[b : b + 1, :, sl]
            kd, vd = (t[b : b + 1, :, sl].repeat_interleave(rep, 1) for t in (k, v))
            pieces.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale))
            s += n
        rows.append(torch.cat(pieces, dim=2))
    out = torch.cat(rows, dim=0)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad
