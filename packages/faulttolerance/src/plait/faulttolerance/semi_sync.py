"""Semi-synchronous training across replica groups: torchft's LocalSGD and DiLoCo.

Groups step on their own and meet every `sync_steps` optimizer steps, so the network across groups
(often the slow one, between hosts or sites) carries one exchange per sync instead of one per step:

  local_sgd: the groups' parameters are averaged (https://arxiv.org/abs/1805.09767).
  diloco:    the mean of (parameters at the last sync - parameters now), the pseudo-gradient, is
             stepped by an outer optimizer from the last synced parameters
             (https://arxiv.org/abs/2311.08105; Nesterov SGD, lr 0.7, momentum 0.9 by default).

Both hook `optimizer.step()`: the sync runs in its post-hook, with a quorum, the average and the
commit vote. A group lost between syncs loses its local steps; a joining group loads a peer's
state at the next sync.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torchft.local_sgd import DiLoCo, LocalSGD

from .replica_group import ReplicaGroup


def outer_optimizer(group: ReplicaGroup, params: Iterable[torch.nn.Parameter]) -> torch.optim.SGD:
    """DiLoCo's outer optimizer from the config: SGD with (Nesterov) momentum."""
    c = group.config
    return torch.optim.SGD(params, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.outer_nesterov)


def semi_sync(group: ReplicaGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              outer: torch.optim.Optimizer | None = None) -> LocalSGD | DiLoCo:
    """The sync wrapper of `group.config.semi_sync`, a context manager around the training loop:

        with semi_sync(group, model, optimizer):
            for step ...: forward, backward, optimizer.step(), optimizer.zero_grad()

    optimizer: the inner (local) optimizer the loop steps. outer: DiLoCo's outer optimizer over
    `model.parameters()` (default: `outer_optimizer(group, model.parameters())`). DiLoCo keeps a
    copy of the parameters at the last sync on the host (one model's worth of memory)."""
    method, every = group.config.semi_sync, group.config.sync_steps
    if method == "local_sgd":
        return LocalSGD(group.manager, model, optimizer, sync_every=every)
    if method == "diloco":
        outer = outer if outer is not None else outer_optimizer(group, model.parameters())
        return DiLoCo(group.manager, [model], optimizer, outer, sync_every=every)
    raise ValueError(f"fault_tolerance.semi_sync = {method!r}: semi_sync() needs local_sgd or diloco.")
