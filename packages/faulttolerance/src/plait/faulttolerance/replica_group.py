"""One replica group's side of fault-tolerant training: the calls a training step makes.

    group = ReplicaGroup(config, state_dict, load_state_dict)   # after the group's own init
    for each step:
        group.begin_step()              # quorum; a (re)joining group loads a peer's state here
        ... read the batch at the data position, forward, backward ...
        group.average_gradients(model.parameters())
        ... clip ...
        if group.should_commit():       # every rank of every group in the quorum agrees
            optimizer.step(); scheduler.step(); advance the data position
        optimizer.zero_grad()

Under semi_sync the step is local: begin_step and average_gradients do nothing, should_commit is
True, and the wrapper from `semi_sync(...)` syncs inside `optimizer.step()` every sync_steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plait.mesh.declared_sync import declared_sync
from plait.mesh.errors import ConfigError

from .config import FaultToleranceConfig
from .errors import QuorumFault
from .grad_average import average_gradients
from .manager import QuorumManager, quorum_failure_line, start_manager
from .process_group import process_group_kind

_REQUORUM_PAUSE_S = 0.1  # between quorums that came back smaller than min_replicas


@dataclass(frozen=True)
class QuorumInfo:
    """What `begin_step` found, for the step's log line.

    participants: replica groups in this step's quorum (the gradient is averaged over them).
    step: committed steps so far; after `recovered`, the peer's.
    recovered: this group has just loaded the live state (model, optimizer, extra) of a peer."""

    participants: int
    step: int
    recovered: bool


class ReplicaGroup:
    """A replica group's handle on torchft: quorum, cross-group gradient average, commit vote.

    state_dict / load_state_dict: what a (re)joining group receives from a live peer, rank r from
    the peer's rank r: the model's and optimizer's state dicts (FSDP's DTensors as they are) and
    any extra state (schedule, data position, step). state_dict() is read while the quorum is
    formed and served until this rank's next `should_commit()`: return the live objects, no copies.
    rank / world_size: this rank in its own group (default: torch.distributed's world).
    store_addr / store_port: the group's TCPStore (default: MASTER_ADDR / MASTER_PORT, as torchrun
    sets them); other groups connect to it, so on several hosts MASTER_ADDR must be routable.
    device: "cuda" or "cpu" (default: plait.mesh's), for the process group across groups."""

    def __init__(self, config: FaultToleranceConfig, state_dict: Callable[[], Any],
                 load_state_dict: Callable[[Any], None], *, rank: int | None = None,
                 world_size: int | None = None, store_addr: str | None = None, store_port: int | None = None,
                 device: str | None = None) -> None:
        self.config = config.validate()
        self._user_load_state_dict = load_state_dict
        self._recovered = False
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
        self.manager: QuorumManager = start_manager(
            config, state_dict, self._load_live_state, rank=rank, world_size=world_size,
            store_addr=store_addr or _env("MASTER_ADDR"), store_port=store_port or int(_env("MASTER_PORT")),
            process_group_kind=process_group_kind(config.process_group, device))

    def _load_live_state(self, state: Any) -> None:
        self._user_load_state_dict(state)
        self._recovered = True

    @property
    def semi_sync(self) -> bool:
        return self.config.semi_sync is not None

    def begin_step(self) -> QuorumInfo:
        """Form this step's quorum, before the batch is read.

        Waits (up to quorum_timeout_s) until at least min_replicas groups are in it, then returns.
        A group behind the quorum's step loads a peer's state here (its load_state_dict runs on
        this thread). Raises QuorumFault, one line naming the lighthouse, when no quorum forms."""
        self._recovered = False
        if self.semi_sync:
            return QuorumInfo(self.participants, self.step, recovered=False)
        deadline = time.monotonic() + self.config.quorum_timeout_s
        with declared_sync("fault tolerance: the step's quorum"):
            too_few_seen = False
            while True:
                remaining = max(deadline - time.monotonic(), 0.001)
                try:
                    self.manager.start_quorum(timeout=_seconds(remaining))
                except QuorumFault:
                    # The wait ran out inside a re-quorum: what it lacked is what the last one had.
                    if too_few_seen:
                        raise QuorumFault(self._too_few_line()) from None
                    raise
                if self.manager.num_participants() >= self.config.min_replicas:
                    break
                too_few_seen = True
                if time.monotonic() >= deadline:
                    raise QuorumFault(self._too_few_line())
                time.sleep(_REQUORUM_PAUSE_S)
        return QuorumInfo(self.participants, self.step, self._recovered)

    def _too_few_line(self) -> str:
        detail = f"{self.manager.num_participants()} group(s) in the quorum, min_replicas = {self.config.min_replicas}"
        return quorum_failure_line(self.manager.lighthouse, self.manager.replica_label,
                                   self.config.quorum_timeout_s, TimeoutError(), detail)

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average every parameter's local gradient (a DTensor's local shard) over the quorum's
        groups, after backward and before clipping. A failure does not raise: the step's
        should_commit() is then False."""
        if self.semi_sync:
            return
        bucket_bytes = int(self.config.bucket_mb * 2**20)
        with declared_sync("fault tolerance: gradient average across replica groups"):
            average_gradients(self.manager, params, bucket_bytes)

    def should_commit(self) -> bool:
        """Whether to step the optimizer: True on every rank of every group in the quorum, or
        False on all of them (a group lost mid-step, a failed collective, a recovery that failed).
        Call once per step, on every rank, after average_gradients."""
        if self.semi_sync:
            return True
        with declared_sync("fault tolerance: the commit vote"):
            return self.manager.should_commit()

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum (0 before the first)."""
        return self.manager.num_participants()

    @property
    def step(self) -> int:
        """Committed steps (under semi_sync: committed syncs), the same on every group."""
        return self.manager.current_step()

    def should_save_checkpoint(self) -> bool:
        """Whether this group writes checkpoints: the first group of the quorum (the lowest
        participating replica_id), so exactly one group writes whichever groups are alive;
        replica 0 before the first quorum."""
        rank = self.manager.participating_rank()
        return rank == 0 if rank is not None else self.config.replica_id == 0

    def state_dict(self) -> dict[str, int]:
        """torchft's own state (committed step, batches committed): save it with a checkpoint."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore torchft's own state when a checkpoint is loaded from disk."""
        self.manager.load_state_dict(state)

    def shutdown(self) -> None:
        """Stop the manager server, the live-state server and the quorum thread."""
        self.manager.shutdown(wait=True)


def _seconds(s: float) -> timedelta:
    return timedelta(seconds=s)


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"fault_tolerance: ${name} is not set, so the replica group's store is unknown: "
                          f"start the group with torchrun, or pass store_addr / store_port.")
    return value
