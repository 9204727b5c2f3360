"""The validation loss: the token-weighted mean cross-entropy over data.val_steps batches of the
validation split, on every layout (pipeline: the last stage's sums; dp x cp: all-reduced)."""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .pipeline import merge_micro_batches
from .run_data import build_loader, data_exchange
from .step import IGNORE_INDEX, token_loss_fn


def validation_loss(trainer) -> float:
    """`trainer`: the Trainer, in eval mode and under no_grad (Trainer.validate_loss)."""
    c = trainer.config
    if trainer._validation_exchange is None:
        trainer._validation_exchange = data_exchange()
    # Under pipeline parallel a validation batch is as large as a training step's local batch
    # (the schedule's micro-batch count is fixed): the accumulation's batches, merged.
    accumulation = c.training.gradient_accumulation_steps if trainer.pipeline is not None else 1
    loader = build_loader(c, trainer.plan, trainer.meshes, c.data.val_dataset, "validation", accumulation,
                          trainer._validation_exchange)
    # [loss sum, valid tokens] over every batch and every dp x cp rank: the token-weighted mean.
    totals = torch.zeros(2, device=trainer.device)
    autocast = trainer.pm.autocast or contextlib.nullcontext()
    n = 0
    for micro_batches in loader:
        if trainer.pipeline is not None:
            micro_batches = merge_micro_batches(micro_batches)
        trainer._read_documents(micro_batches)
        for micro_batch in micro_batches:
            inputs_BS, labels_BS, positions, documents_BS, _ = trainer.runner.local_batch(*micro_batch)
            with trainer.runner.loss_context(), autocast:
                if trainer.pipeline is not None:  # the loss sum on the last stage's rank, else None
                    loss = trainer.pipeline.eval_step(
                        inputs_BS, labels_BS, positions=positions, document_positions=documents_BS,
                        **trainer.runner.head_labels(labels_BS),
                    )
                    loss = torch.zeros((), device=trainer.device) if loss is None else loss
                else:
                    out = trainer.runner.forward(inputs_BS, positions, documents_BS, labels_BS=labels_BS)
                    loss = token_loss_fn(trainer.config)(out, labels_BS)
            totals[0] += loss.full_tensor() if isinstance(loss, DTensor) else loss
            totals[1] += (labels_BS != IGNORE_INDEX).sum()
            n += 1
        if n >= c.data.val_steps:
            break
    if trainer.pipeline is not None:  # the loss sums live on the last stage's ranks
        loss_sum = totals[0].clone()
        dist.all_reduce(loss_sum, group=trainer.meshes.pp.get_group())
        totals[0] = loss_sum
    if trainer.meshes.dp_cp is not None:
        dist.all_reduce(totals, group=trainer.meshes.dp_cp.get_group())
    return (totals[0] / totals[1].clamp(min=1)).item()
