"""One training step, whoever runs it: plait-train's loop (train.py) and plait-plan's traced step
build a `StepRunner` from the same parts (the parallelized model, the optimizer, the schedule,
the meshes) and call `train_step(micro_batches)`: the batch split (context parallel's shard,
document offsets), the loss scale over the global batch, forward / backward per micro-batch (or the
pipeline schedule), clipping over every mesh, the optimizer and schedule step, MoE bookkeeping.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.mesh import clip_grad_norm_, grad_norm
from plait.models.documents import MIN_DOCUMENTS_PER_ROW, documents_capacity, row_segments, to_device_with_segments

from .config import ConfigError
from .float8 import after_optimizer_step
from .loss_head import LABELS_KWARG, summed_token_losses
from .mtp import IGNORE_INDEX, depth_losses, mtp_depths, objective, shifted_rows


def cross_entropy_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (labels = -100 are ignored); the caller divides by the
    global number of valid tokens."""
    return F.cross_entropy(
        logits_BSV.flatten(0, 1).float(), labels_BS.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def token_loss_fn(config):
    """The step's summed token loss for training.loss: on logits (full), or on the per-token
    losses a chunked loss head returns (chunked)."""
    return summed_token_losses if config.training.loss == "chunked" else cross_entropy_loss


class StepRunner:
    """What one step reads, given at construction: `pm` (parallelize's ParallelModel), its
    optimizer and LR schedule, `moe` (MoEStep or None), `loss_fn` (the summed token loss, maybe
    compiled; None: the one training.loss calls for), `pipeline` (the schedule under pp > 1, else None)."""

    def __init__(self, config, plan, meshes, pm, optimizer, scheduler, device: torch.device, *,
                 moe=None, loss_fn=None, pipeline=None):  # fmt: skip
        self.config, self.plan, self.meshes, self.device = config, plan, meshes, device
        self.pm, self.model = pm, pm.model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.moe, self.loss_fn, self.pipeline = moe, loss_fn or token_loss_fn(config), pipeline
        # training.loss = chunked: the model's head takes the labels and returns per-token losses.
        self.chunked = config.training.loss == "chunked"
        self.loss_context = self._loss_context_factory()
        # Around each micro-batch's host work before its forward (the planner counts it per micro-batch).
        self.micro_batch_context = contextlib.nullcontext
        # Fault tolerance (the trainer sets it): the gradient average across replica groups and the
        # commit vote; `committed` says whether the last step stepped the optimizer.
        self.replica_group = None
        self.committed = True

    def _loss_context_factory(self):
        if self.pm.loss_parallel:
            tp = self.plan.parallel_modules["tp"]
            return lambda: tp.loss_parallel_context(True)
        return contextlib.nullcontext

    # Documents per row the attention offsets have room for (the high-water mark of _read_documents).
    _documents_capacity = MIN_DOCUMENTS_PER_ROW

    def local_batch(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, document_positions_BS=None):
        """(tokens, labels, RoPE positions, document positions, MTP rows) this rank computes: under
        context parallel its share of every sequence in the load-balanced order, with the positions
        of those tokens (global, or per document); the document positions stay whole rows (attention
        reads every boundary), and only under attention_mask = "document". MTP rows (model.mtp_layers,
        else None): (tokens_KBS, labels_KBS) of every depth, shifted on whole rows then split alike."""
        inputs_BS = inputs_BS.to(self.device, non_blocking=True)
        labels_BS = labels_BS.to(self.device, non_blocking=True)
        documents = None
        if self.plan.model_args.attention_mask == "document":
            # Room for this batch too, when no step read it first (a planner's traced step).
            self._documents_capacity = documents_capacity(row_segments(document_positions_BS), self._documents_capacity)
            documents = to_device_with_segments(document_positions_BS, self.device, self._documents_capacity)
        depths = mtp_depths(self.plan.model_args)
        mtp = shifted_rows(inputs_BS, labels_BS, depths, documents) if depths else None
        layout = self.pm.cp_layout
        if layout is None:
            # A later pipeline stage receives hidden states, sequence-sharded under sequence
            # parallel: it cannot size RoPE from them, so every stage gets the positions.
            positions = torch.arange(inputs_BS.shape[1], device=self.device) if self.pipeline is not None else None
            return inputs_BS, labels_BS, positions, documents, mtp
        from plait.contextparallel import shard_batch, shard_sequence

        cp_rank = self.meshes.cp.get_local_rank()
        tokens, labels, positions = shard_batch(inputs_BS, labels_BS, cp_rank, layout)
        if documents is not None and self.plan.model_args.rope_positions == "document":
            positions = shard_sequence(documents, 1, cp_rank, layout)
        if mtp is not None:
            mtp = tuple(shard_sequence(rows_KBS, 2, cp_rank, layout) for rows_KBS in mtp)
        return tokens, labels, positions, documents, mtp

    def head_labels(self, labels_BS, mtp=None) -> dict:
        """The model call's keyword for a chunked loss head (loss_head.py): the main labels and each
        MTP depth's, [B, 1 + K, S]; nothing under training.loss = full."""
        return {LABELS_KWARG: self._all_labels(labels_BS, mtp).transpose(0, 1)} if self.chunked else {}

    def forward(self, tokens_BS, positions, documents_BS, mtp=None, labels_BS=None):
        """The model's logits; with MTP rows, (logits, [logits of each depth]). Under training.loss =
        chunked (`labels_BS` given) per-token losses in place of logits."""
        extra = {} if mtp is None else {"mtp_tokens": mtp[0].transpose(0, 1)}  # [B, K, S]
        if labels_BS is not None:
            extra.update(self.head_labels(labels_BS, mtp))
        if documents_BS is None:  # causal: the two-argument call every model takes
            return self.model(tokens_BS, positions, **extra)
        return self.model(tokens_BS, positions, documents_BS, **extra)

    def read_documents(self, micro_batches) -> None:
        """Under attention_mask = "document": read each micro-batch's segments on the host from the
        loader's CPU tensor, before the step (so the step itself never reads them back from the
        device), and refuse per-document positions past the RoPE tables."""
        args = self.plan.model_args
        if args.attention_mask != "document":
            return
        for _, _, document_positions_BS in micro_batches:
            # The offsets keep room for the most documents a row has held so far (a power of two):
            # one shape for the run's compiled blocks and CUDA graphs, growing a handful of times.
            self._documents_capacity = documents_capacity(row_segments(document_positions_BS), self._documents_capacity)
            if args.rope_positions == "document":
                longest = int(document_positions_BS.max()) + 1
                if longest > args.max_seq_len:
                    raise ConfigError(
                        f"model.rope_positions = 'document': a document reaches {longest} tokens, past "
                        f"model.max_seq_len = {args.max_seq_len} (the RoPE tables): raise model.max_seq_len "
                        "or set model.rope_positions = 'sequence'."
                    )

    @staticmethod
    def _valid_tokens(labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's valid labels; labels [K, B, S] (MTP: main and each depth) count per
        leading index: a [K] count."""
        return (labels != IGNORE_INDEX).flatten(-2).sum(-1)

    def _global_token_count(self, counts: list[torch.Tensor]) -> torch.Tensor:
        """Valid labels over every micro-batch (`counts`: each one's _valid_tokens) and every dp x cp
        rank (one all-reduce, no host sync)."""
        count = torch.stack(counts).sum(0).float()
        if self.meshes.dp_cp is not None:
            dist.all_reduce(count, group=self.meshes.dp_cp.get_group())
        return count.clamp(min=1.0)

    def _clip(self) -> torch.Tensor:
        params = list(self.pm.inner.parameters())
        max_norm = self.config.training.max_norm
        # Under pipeline parallel each rank holds its stages' parameters: the norm spans the pp ranks.
        pp = {"pp_mesh": self.meshes.pp} if self.pipeline is not None else {}
        if max_norm > 0:
            return clip_grad_norm_(params, max_norm, foreach=True, **pp)
        return grad_norm(params, foreach=True, **pp)

    def _loss_scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """ranks / valid tokens of the global batch: scaling each rank's loss sum by it makes the
        step's gradient the mean over every valid token (data parallel averages over dp x cp).
        Labels [1 + K, B, S] (main and each MTP depth's): one scale per loss, one all-reduce."""
        return self._scale_of_counts([self._valid_tokens(lab) for lab in labels])

    def _scale_of_counts(self, counts: list[torch.Tensor]) -> torch.Tensor:
        ranks = self.meshes.dp_cp.size() if self.meshes.dp_cp is not None else 1
        return ranks / self._global_token_count(counts)

    @staticmethod
    def _all_labels(labels_BS: torch.Tensor, mtp) -> torch.Tensor:
        return labels_BS[None] if mtp is None else torch.cat([labels_BS[None], mtp[1]])

    def _update(self) -> torch.Tensor:
        """Clip (over every mesh, and every stage under pp), step, schedule; the gradient norm.
        Replica groups: the gradients are averaged across them first (so every group clips the same
        norm), and the step is taken only where every group in the quorum commits it."""
        if self.replica_group is not None:
            self.replica_group.average_gradients(self.pm.inner.parameters())
        norm = self._clip()
        self.committed = self.replica_group is None or self.replica_group.should_commit()
        if not self.committed:
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.pm.float8_all_gather:
            after_optimizer_step(self.pm.inner)  # the float8 weights' scales for the next all-gathers
        if self.moe is not None:
            self.moe.after_step()
        return norm

    def _pipeline_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        """One step under pipeline parallel: the local batch (the accumulation micro-batches
        merged, see pipeline.merge_micro_batches) through the schedule; the loss, reported once from
        the last stage, summed over the pp ranks (the others contribute 0)."""
        (inputs_BS, labels_BS, positions, documents_BS, mtp), = [self.local_batch(*mb) for mb in micro_batches]
        if self.moe is not None:  # each stage's MoE aux losses, one per pipeline micro-batch
            self.moe.configure_aux_loss(self.pipeline.n_microbatches)
        autocast = self.pm.autocast or contextlib.nullcontext()
        kwargs = dict(positions=positions, document_positions=documents_BS)
        labels_main = labels_BS
        if mtp is None:
            scale = self._loss_scale([labels_BS])
        else:  # each loss's scale inside the MTP loss; the depths' rows go to every stage
            mtp_loss, scale = self.pipeline.loss.loss_fn, 1.0
            mtp_loss.start_step(self._loss_scale([self._all_labels(labels_BS, mtp)]))
            labels_BS = torch.cat([labels_BS[:, None], mtp[1].transpose(0, 1)], 1).flatten(1)  # [B, (1 + K) S]
            kwargs["mtp_tokens"] = mtp[0].transpose(0, 1)
        kwargs.update(self.head_labels(labels_main, mtp))  # for a chunked loss head on the last stage
        with self.loss_context(), autocast:
            loss = self.pipeline.step(inputs_BS, labels_BS, scale=scale, **kwargs)
        if mtp is not None:  # the main loss, then each depth's: the last stage's, summed over micro-batches
            # (the last n: torch's shape inference on the first step computes a loss of its own first)
            parts = self.pipeline.loss.loss_fn.parts[-self.pipeline.n_microbatches :]
            loss = torch.stack([torch.stack(p) for p in parts]).sum(0) if parts else None
        if isinstance(loss, DTensor):  # tensor parallel: a replicated DTensor
            loss = loss.full_tensor()
        size = 1 + (0 if mtp is None else mtp[0].shape[0])
        step_loss = loss.detach().float().reshape(-1) if loss is not None else torch.zeros(size, device=self.device)
        dist.all_reduce(step_loss, group=self.meshes.pp.get_group())
        return (step_loss if mtp is not None else step_loss[0]), self._update()

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pipeline is not None:
            return self._pipeline_step(micro_batches)
        if self.moe is not None:  # the MoE aux loss trains in each forward's backward: 1 / accumulation
            self.moe.configure_aux_loss(len(micro_batches))
        autocast = self.pm.autocast or contextlib.nullcontext()
        depths = mtp_depths(self.plan.model_args)
        # A micro-batch is (inputs, labels, document_positions). Without MTP, [B, S] labels and one
        # 0-dim scale (the planner's traced step holds the same tensors as the real one, to the
        # byte); with it, every depth's labels too and one scale per loss.
        batches, counts = [], []
        for micro_batch in micro_batches:
            with self.micro_batch_context():
                batches.append(self.local_batch(*micro_batch))
                labels = self._all_labels(batches[-1][1], batches[-1][4]) if depths else batches[-1][1]
                counts.append(self._valid_tokens(labels))
        # Data parallel averages gradients over the dp x cp ranks; scaling each rank's loss sum by
        # ranks / (valid tokens of the global batch) makes the step's gradient the mean over every
        # valid token, however they are split over ranks, micro-batches and ignored labels.
        scales = self._scale_of_counts(counts) if depths else self._scale_of_counts(counts)[None]
        del counts, labels  # not held through the forwards (the planner traces one micro-batch's)
        # The main loss, then each MTP depth's (logged; the step optimises main + scale x their mean).
        step_losses = torch.zeros(1 + depths, device=self.device)
        for inputs_BS, labels_BS, positions, documents_BS, mtp in batches:
            with self.loss_context():
                with autocast:
                    out = self.forward(inputs_BS, positions, documents_BS, mtp, labels_BS)
                    logits_BSV, *depth_logits = out if mtp is not None else (out,)
                    losses = [self.loss_fn(logits_BSV, labels_BS) * scales[0]]
                    if mtp is not None:
                        losses += depth_losses(self.loss_fn, depth_logits, mtp[1], scales[1:])
                    total = objective(losses, getattr(self.plan.model_args, "mtp_loss_scale", 0.0))
                total.backward()
                for i, loss in enumerate(losses):
                    detached = loss.detach()
                    step_losses[i] += detached.full_tensor() if isinstance(detached, DTensor) else detached
        return (step_losses if depths else step_losses[0]), self._update()
