"""The output projection fused with its cross-entropy, over chunks of tokens (training.loss = chunked).

The unfused loss materialises logits [T, V], their fp32 upcast, their log-softmax and the
gradient of all of them: at seq 8192 and a 128k vocabulary, several GiB per row. Here one
autograd function takes the final hidden states, the output weight and the labels, and returns
each token's loss. Its forward runs the projection and the softmax statistics one chunk of
`chunk_tokens` tokens at a time and keeps only the per-token log-sum-exp [T] (fp32); its backward
recomputes each chunk's logits from it, writes that chunk's rows of grad_h and accumulates grad_W.
At no time is more than one chunk of logits alive (Megatron's fused output layer + cross-entropy,
Liger's and Apple's cut-cross-entropy kernels: the same idea, here in plain torch, so it runs on
CPU and GPU alike and compiles without a graph break).

Precision follows the unfused path step for step: the product in the compute dtype (autocast's
where it is on; fp32 kernels on bf16 operands where plait.models.cpu_bf16 says so), the logits then
upcast to fp32 for the softmax, the gradient of the logits rounded to the compute dtype for the
two backward products.

Vocab-parallel (tensor parallel): with `group`, `weight` is this rank's rows of the vocabulary,
starting at `vocab_start`. Per chunk, each rank computes its shard's log-sum-exp and the target
logit where it holds the target; one all-gather of those [2, chunk] pairs gives every rank the
global log-sum-exp and target logit (Megatron's vocab_parallel_cross_entropy, with the max and
sum all-reduces folded into one collective). The backward needs no collective: the local
gradient of the logits is exp(logits - lse) - onehot on the local shard, and grad_h is a partial
sum over the TP ranks, which the caller's region reduces.
"""

import torch
import torch.distributed as dist

from plait.models.cpu_bf16 import compute_dtype, cpu_multiplies_in_fp32

IGNORE_INDEX = -100


def _product(a: torch.Tensor, b: torch.Tensor, fp32_kernels: bool) -> torch.Tensor:
    """a @ b in their dtype; bf16 operands through fp32 kernels, rounded once, where asked."""
    if fp32_kernels:
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def _shard_statistics(logits_CV: torch.Tensor, labels_C: torch.Tensor, vocab_start: int):
    """(log-sum-exp over this shard's vocabulary, the target's logit where this shard holds it, else 0)."""
    local_C = labels_C - vocab_start
    held_C = (local_C >= 0) & (local_C < logits_CV.shape[1])
    target_C = logits_CV.gather(1, local_C.clamp(0, logits_CV.shape[1] - 1)[:, None])[:, 0]
    return torch.logsumexp(logits_CV, dim=1), torch.where(held_C, target_C, 0.0)


def _across_shards(lse_C: torch.Tensor, target_C: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The global log-sum-exp and target logit from every rank's shard (one all-gather)."""
    pair_2C = torch.stack([lse_C, target_C])
    ranks = dist.get_world_size(group)
    gathered = pair_2C.new_empty((ranks * 2, pair_2C.shape[1]))  # concatenated on dim 0 (gloo's shape)
    dist.all_gather_single(gathered, pair_2C, group=group)
    gathered_R2C = gathered.view(ranks, 2, -1)
    return torch.logsumexp(gathered_R2C[:, 0], dim=0), gathered_R2C[:, 1].sum(0)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, weight_VD, labels_X, chunk_tokens, fp32_kernels, group, vocab_start):
        T, labels_T = h_TD.shape[0], labels_X.flatten()
        lse_T = h_TD.new_empty(T, dtype=torch.float32)
        # Shaped like the labels and returned as is (not a view: FSDP's hooks warn of views).
        loss_X = h_TD.new_empty(labels_X.shape, dtype=torch.float32)
        loss_T = loss_X.view(T)
        weight_DV = weight_VD.t()
        for start in range(0, T, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, T))
            logits_CV = _product(h_TD[rows], weight_DV, fp32_kernels).float()
            lse_C, target_C = _shard_statistics(logits_CV, labels_T[rows], vocab_start)
            del logits_CV  # before the next chunk's
            if group is not None:
                lse_C, target_C = _across_shards(lse_C, target_C, group)
            lse_T[rows] = lse_C
            loss_T[rows] = torch.where(labels_T[rows] != IGNORE_INDEX, lse_C - target_C, 0.0)
        ctx.save_for_backward(h_TD, weight_VD, labels_T, lse_T)
        ctx.chunk_tokens, ctx.fp32_kernels, ctx.vocab_start = chunk_tokens, fp32_kernels, vocab_start
        return loss_X

    @staticmethod
    def backward(ctx, grad_loss_X):
        h_TD, weight_VD, labels_T, lse_T = ctx.saved_tensors
        grad_loss_T = grad_loss_X.reshape(-1)
        T, V = h_TD.shape[0], weight_VD.shape[0]
        grad_h_TD = torch.empty_like(h_TD) if ctx.needs_input_grad[0] else None
        grad_weight_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        # Ignored tokens have no loss: their rows of the gradient are zero.
        scale_T = torch.where(labels_T != IGNORE_INDEX, grad_loss_T.float(), 0.0)
        weight_DV = weight_VD.t()
        for start in range(0, T, ctx.chunk_tokens):
            rows = slice(start, min(start + ctx.chunk_tokens, T))
            h_CD = h_TD[rows]
            logits_CV = _product(h_CD, weight_DV, ctx.fp32_kernels).float()
            # d loss / d logits = softmax - onehot(target), on this shard's columns.
            grad_CV = logits_CV.sub_(lse_T[rows, None]).exp_()  # in place: one [C, V] fp32 buffer
            local_C = labels_T[rows] - ctx.vocab_start
            held_C = (local_C >= 0) & (local_C < V)
            grad_CV.scatter_add_(1, local_C.clamp(0, V - 1)[:, None], -held_C.to(grad_CV.dtype)[:, None])
            grad_CV = grad_CV.mul_(scale_T[rows, None]).to(h_TD.dtype)
            if grad_h_TD is not None:
                grad_h_TD[rows] = _product(grad_CV, weight_VD, ctx.fp32_kernels)
            grad_weight_VD += _product(grad_CV.t(), h_CD, ctx.fp32_kernels)
        grad_weight_VD = grad_weight_VD.to(weight_VD.dtype) if ctx.needs_input_grad[1] else None
        return grad_h_TD, grad_weight_VD, None, None, None, None, None


def chunked_linear_cross_entropy(
    h_XD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_X: torch.Tensor,
    chunk_tokens: int,
    group=None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """Each token's cross-entropy of the logits `h_XD @ weight_VD.T` against `labels_X` (any
    leading shape X; -100 ignored: loss 0, no gradient), fp32, shaped like `labels_X`, computed
    `chunk_tokens` tokens at a time. `group`, `vocab_start`: the vocab-parallel case (module doc)."""
    if h_XD.shape[:-1] != labels_X.shape:
        raise ValueError(f"chunked cross-entropy: hidden states {tuple(h_XD.shape)} and labels "
                         f"{tuple(labels_X.shape)} must share their leading dims (one label per token).")
    dtype = compute_dtype(h_XD)
    fp32_kernels = cpu_multiplies_in_fp32(dtype, h_XD.device)
    # Autocast's casts, made here so the function's own products run in one dtype both ways.
    h_TD, weight_VD = h_XD.to(dtype).flatten(0, -2), weight_VD.to(dtype)
    with torch.autocast(h_XD.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h_TD, weight_VD, labels_X, chunk_tokens, fp32_kernels, group,
                                                vocab_start)  # fmt: skip
