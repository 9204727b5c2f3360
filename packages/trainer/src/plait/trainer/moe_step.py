"""What a training step does for MoE models around forward/backward: the aux loss's settings, the
load-balance bias update, and the step's MoE metrics.

- Aux loss (model.aux_loss_coeff > 0): each router ties its sequence-wise balance loss into its
  MoE block's output (plait.models.moe.configure_moe_aux_loss), so the loss trains inside that
  block's backward and is never added to the step's loss. Before a step the routers get its
  gradient weight, 1 / (forwards per optimizer step x tp), and under context parallel the sum of
  each layer's expert-choice counts over the cp ranks (a functional all-reduce in the forward).

- Load balance: the routers' token counts summed over every rank that routed different tokens
  (dp x cp; TP ranks route the same tokens inside the MoE's TP region, expert parallel moves
  tokens but not routing decisions), so every rank applies the same bias update.
- Metrics per step, all on the device until the metrics flush: load imbalance per MoE layer
  (max / mean tokens per expert, from those same summed counts; 1.0 is perfect balance); under
  expert parallel the same per EP rank (the rows of its experts, summed), the factor by which the
  busiest rank's expert work exceeds the mean: the other ranks wait for it in the all-to-alls,
  which no overlap hides (benchmarks/comm_skew.py measures that wait);
  (token, expert) pairs the capacity mode dropped on this rank, and the dispatchers' host syncs.
- Pipeline parallel: each MoE layer lives on one stage, its aux loss in that stage's backward; the
  imbalance of every layer reaches every rank (each stage fills its layers' slots, summed over pp).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


class MoEStep:
    def __init__(self, model: nn.Module, model_args, meshes, dispatchers: dict | None, whole_model=None):
        self.model = model
        self.group = meshes.dp_cp.get_group() if meshes.dp_cp is not None else None
        self.tp = meshes.dims.tp
        self.cp = meshes.dims.cp
        self.cp_group = meshes.cp.get_group() if meshes.cp is not None else None
        self.ep = meshes.dims.ep
        self.coeff = getattr(model_args, "load_balance_coeff", 0.0) or 0.0
        self.aux_enabled = bool(getattr(model_args, "aux_loss_coeff", 0.0))
        self._aux_forwards: int | None = None  # the forwards per step the routers were set for
        self.dispatchers = dispatchers or {}
        self._imbalance_L: torch.Tensor | None = None
        self._ep_imbalance_L: torch.Tensor | None = None
        self._host_syncs_seen = self._host_syncs()
        self._dropped_seen: torch.Tensor | None = None
        # Pipeline parallel: this rank's routers' slots among the whole model's MoE layers.
        self.pp_group, self._slots, self._n_layers = None, None, 0
        if meshes.pp is not None and whole_model is not None:
            names = _router_names(whole_model)
            self.pp_group = meshes.pp.get_group()
            # An index tensor made once here, not from a Python list inside the step.
            slots = [names.index(n) for n in _router_names(model)]
            self._slots = torch.tensor(slots, dtype=torch.long, device=self._device())
            self._n_layers = len(names)

    @classmethod
    def for_model(
        cls, model: nn.Module, model_args, meshes, dispatchers: dict | None, whole_model: nn.Module | None = None
    ) -> "MoEStep | None":
        """`whole_model`: under pipeline parallel, the unsplit model (meta) whose MoE layers the stages share."""
        try:
            from plait.models.moe.router import TokenChoiceTopKRouter  # noqa: F401
        except ImportError:
            return None
        if not _router_names(whole_model if whole_model is not None else model):
            return None
        return cls(model, model_args, meshes, dispatchers, whole_model)

    def configure_aux_loss(self, forwards: int) -> None:
        """Before a step of `forwards` forward passes per optimizer step (accumulation micro-batches,
        or the pipeline's micro-batches): every router's aux-loss settings (nothing when the aux
        loss is off, or when they are already these)."""
        if not self.aux_enabled or forwards == self._aux_forwards:
            return
        from plait.models.moe import configure_moe_aux_loss

        # The step's objective averages its forwards. Every TP rank computes the same aux loss inside
        # the MoE's TP region, whose entry sums the ranks' input gradients: each rank weighs it 1/tp,
        # so the gradient arrives exactly once. Context parallel: each rank routed part of every
        # sequence; the counts are summed over the cp ranks and each rank's term carries its own
        # tokens' affinities (the gradient average over dp x cp takes the mean over the parts).
        configure_moe_aux_loss(
            self.model, grad_scale=1.0 / (forwards * self.tp), sequence_parts=self.cp,
            reduce_counts=self._sum_over_cp if self.cp > 1 else None,
        )  # fmt: skip
        self._aux_forwards = forwards

    def _sum_over_cp(self, counts: torch.Tensor) -> torch.Tensor:
        # Functional: waited at first use, and saved rather than repeated by selective AC.
        return funcol.all_reduce(counts, "sum", self.cp_group)

    def _reduce_counts(self, counts_LE: torch.Tensor) -> None:
        if self.group is not None:
            dist.all_reduce(counts_LE, group=self.group)
        counts_LE = counts_LE.float()
        self._imbalance_L = max_over_mean(counts_LE)
        if self.ep > 1:
            self._ep_imbalance_L = max_over_mean(ep_rank_rows(counts_LE, self.ep))
        if self.pp_group is not None:
            self._imbalance_L, self._ep_imbalance_L = self._gather_stages(self._imbalance_L, self._ep_imbalance_L)

    def _gather_stages(self, *local_L: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Every MoE layer's values on every rank: each stage fills its own layers' slots (one
        all-reduce for all of them; None stays None, the same on every stage)."""
        present = [x for x in local_L if x is not None]
        whole_KL = torch.zeros(len(present), self._n_layers, device=self._device())
        whole_KL[:, self._slots] = torch.stack(present)
        dist.all_reduce(whole_KL, group=self.pp_group)
        rows = iter(whole_KL.unbind(0))
        return [None if x is None else next(rows) for x in local_L]

    @torch.no_grad()
    def after_step(self) -> None:
        """Once per optimizer step: move the bias (a zero step when balancing is off) and reset
        the counters; the summed counts also give the step's imbalance."""
        from plait.models.moe import update_moe_load_balance

        if self.pp_group is not None and not len(self._slots):
            # A stage without MoE layers still takes part in the imbalance's all-reduce over pp.
            empty = torch.zeros(0, device=self._device())
            self._imbalance_L, self._ep_imbalance_L = self._gather_stages(empty, empty if self.ep > 1 else None)
            return
        update_moe_load_balance(self.model, self.coeff, reduce_counts=self._reduce_counts)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _dropped(self) -> torch.Tensor | None:
        """(token, expert) pairs the capacity mode dropped on this rank so far; None when dropless."""
        drops = [d.dropped for d in self.dispatchers.values() if getattr(d, "dropped", None) is not None]
        return torch.stack([d.reshape(()) for d in drops]).sum() if drops else None

    def dropped_total(self) -> int | None:
        total = self._dropped()
        return None if total is None else int(total)

    def _host_syncs(self) -> int:
        return sum(d.host_syncs for d in self.dispatchers.values())

    def step_metrics(self) -> dict:
        """This step's MoE metrics (device tensors and ints, no sync); call after after_step."""
        metrics: dict = {}
        if self._imbalance_L is not None:
            metrics["moe_imbalance"] = self._imbalance_L
        if self._ep_imbalance_L is not None:
            metrics["moe_ep_imbalance"] = self._ep_imbalance_L
        if self.dispatchers:
            syncs = self._host_syncs()
            metrics["moe_host_syncs"] = syncs - self._host_syncs_seen
            self._host_syncs_seen = syncs
        total = self._dropped()
        if total is not None:
            seen = self._dropped_seen if self._dropped_seen is not None else torch.zeros_like(total)
            metrics["moe_dropped"] = total - seen
            self._dropped_seen = total
        return metrics


def max_over_mean(x_LN: torch.Tensor) -> torch.Tensor:
    """Per row, the largest entry over the mean (1.0: all equal)."""
    return x_LN.max(dim=1).values / x_LN.mean(dim=1).clamp(min=1e-9)


def ep_rank_rows(counts_LE: torch.Tensor, ep: int) -> torch.Tensor:
    """Rows per EP rank and layer [L, ep] from the tokens per expert [L, E]: expert parallel shards
    the experts on dim 0, rank r holding experts r * E / ep to (r + 1) * E / ep - 1. The counts are
    summed over every routing rank, so with several EP groups this is their mean per EP rank."""
    L, E = counts_LE.shape
    return counts_LE.view(L, ep, E // ep).sum(dim=2)


def _router_names(model: nn.Module) -> list[str]:
    from plait.models.moe.router import TokenChoiceTopKRouter

    return [name for name, m in model.named_modules() if isinstance(m, TokenChoiceTopKRouter)]
