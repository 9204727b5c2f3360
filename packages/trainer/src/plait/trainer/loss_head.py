"""training.loss = chunked in the model: its `output` linear swapped for a LossHead.

The model file stays as written ("parallelism is applied to an unmodified model"): it ends with
`self.output(self.norm(h))` and returns what that call returns. The trainer swaps `output` for a
LossHead before anything is parallelised, with the same `weight` parameter (the same name
`output.weight`: checkpoints, the tensor-parallel plan's path, FSDP's ["norm", "output"] unit and
a tied embedding are unchanged). Called with the final hidden states, the head returns each
token's cross-entropy (chunked_loss.py) instead of logits, so every model's own handling of its
head's output still holds (DeepSeek-V3 splits one call over the main row and its MTP depths into
one output per depth). The step's loss is then the sum of those per-token losses (`summed_token_losses`).

The head needs the labels of the tokens it is called on. The step passes them to the model call
as the keyword LABELS_KWARG ([B, 1 + K, S]: the main labels and each MTP depth's); a forward
pre-hook on the called module (the model, or each pipeline stage: torch's schedules split keyword
inputs into micro-batches along the batch) takes it out before the model's forward sees it and
hands the head [(1 + K) B, S], the order in which the depths' hidden states reach it.

The whole chunk loop runs inside one call of the head module: FSDP gathers the weight once per
step and reduce-scatters its gradient once; under tensor parallel the plan string "loss_head"
(plait-tensorparallel) shards the weight on the vocabulary and the loss is vocab-parallel.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .chunked_loss import chunked_linear_cross_entropy
from .config import ConfigError

LABELS_KWARG = "loss_labels"
# Automatic chunk: the largest power of two whose fp32 logits take at most this many elements
# (256 MiB: at a 128k vocabulary 512 tokens, at the debug models' 2k vocabulary 32k tokens).
AUTO_CHUNK_ELEMENTS = 2**26


def chunk_tokens_for(chunk_tokens: int, vocab_size: int) -> int:
    """training.loss_chunk_tokens, 0 (auto) sized from the vocabulary."""
    if chunk_tokens > 0:
        return chunk_tokens
    return 1 << max(0, (AUTO_CHUNK_ELEMENTS // max(vocab_size, 1)).bit_length() - 1)


class LossHead(nn.Module):
    """The output projection and its cross-entropy in one call: hidden states [..., D] -> each
    token's loss [...] (fp32; 0 where the label is ignored). `weight` [V, D] is the swapped
    linear's own parameter."""

    def __init__(self, linear: nn.Linear, chunk_tokens: int):
        super().__init__()
        if linear.bias is not None:
            raise ConfigError("training.loss = chunked: the output layer has a bias, which LossHead does not take; "
                             "set training.loss = full.")
        self.weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.chunk_tokens = chunk_tokens
        self.loss = chunked_linear_cross_entropy  # compile_loss() under training.compile
        self.labels: torch.Tensor | None = None  # the current call's, set by the pre-hook

    def forward(self, h_XD: torch.Tensor) -> torch.Tensor:
        labels, self.labels = self.labels, None  # one call per labelled model call
        if labels is None:
            raise RuntimeError(f"training.loss = chunked: the output head was called without labels; call the model "
                               f"with {LABELS_KWARG}=[B, 1 + K, S] labels (StepRunner.forward does).")
        weight = self.weight
        if isinstance(weight, DTensor):  # vocab-parallel: this rank's rows of the vocabulary
            local = weight.to_local()
            mesh = weight.device_mesh
            return chunked_linear_cross_entropy(h_XD, local, labels, self.chunk_tokens, mesh.get_group(),
                                                mesh.get_local_rank() * local.shape[0])  # fmt: skip
        return self.loss(h_XD, weight, labels, self.chunk_tokens)

    def compile_loss(self) -> None:
        """training.compile: the chunked loss as one compiled graph (no break), as the unfused loss
        is compiled; single-device only (the vocab-parallel form calls its collective eagerly)."""
        self.loss = torch.compile(chunked_linear_cross_entropy, fullgraph=True)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, chunk_tokens={self.chunk_tokens}"


def use_loss_head(model: nn.Module, info: dict, config) -> None:
    """Under training.loss = chunked: swap `model.output` (built, on meta) for a LossHead, and its
    tensor-parallel plan entry for "loss_head"."""
    t = config.training
    if t.loss != "chunked":
        return
    output = getattr(model, "output", None)
    if not isinstance(output, nn.Linear):
        raise ConfigError(f"training.loss = chunked fuses the model's `output` linear with the loss; "
                          f"{config.model.name} has none: set training.loss = full.")
    model.output = LossHead(output, chunk_tokens_for(t.loss_chunk_tokens, output.out_features))
    if "output" in info.get("tp_plan", {}):
        info["tp_plan"] = {**info["tp_plan"], "output": "loss_head"}


def loss_head_of(module: nn.Module) -> LossHead | None:
    head = getattr(module, "output", None)
    return head if isinstance(head, LossHead) else None


def take_labels(module: nn.Module) -> None:
    """Register the pre-hook that moves the LABELS_KWARG keyword of a call of `module` (the model,
    or a pipeline stage module) to its head; a stage without the head drops it."""

    def pre_hook(mod, args, kwargs):
        if LABELS_KWARG not in kwargs:
            return None
        kwargs = dict(kwargs)
        labels_BKS = kwargs.pop(LABELS_KWARG)
        head = loss_head_of(mod)
        if head is not None:
            head.labels = labels_BKS.transpose(0, 1).flatten(0, 1)  # [(1 + K) B, S]: main, then each depth
        return args, kwargs

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def summed_token_losses(losses_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The step's loss function under training.loss = chunked: the head's per-token losses summed
    (ignored labels are 0 there), cross_entropy_loss's value."""
    if losses_BS.shape != labels_BS.shape:
        raise ValueError(f"training.loss = chunked: per-token losses {tuple(losses_BS.shape)} and labels "
                         f"{tuple(labels_BS.shape)} differ in shape.")
    return losses_BS.sum()
