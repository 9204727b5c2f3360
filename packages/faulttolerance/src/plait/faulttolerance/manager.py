"""torchft's Manager for one replica group, started from a FaultToleranceConfig.

The Manager talks to the lighthouse (rank 0 of the group runs its manager server), rebuilds the
process group across groups on every new quorum and serves / fetches the live state. Two things
are ours: a quorum that fails says so in one line naming the lighthouse (`QuorumFault`), and the
quorum is synchronous (see `start_manager`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torchft.manager import MANAGER_PORT_ENV, Manager

from plait.mesh.errors import ConfigError

from .config import FaultToleranceConfig
from .errors import QuorumFault
from .process_group import replicate_process_group


class QuorumManager(Manager):
    """A torchft Manager whose failed quorum raises `QuorumFault` (what `start_quorum` raises
    when the lighthouse times out or is gone is a bare TimeoutError / RuntimeError)."""

    lighthouse: str = ""
    replica_label: str = ""

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False,
                     timeout: timedelta | None = None) -> None:
        try:
            super().start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout)
        except Exception as e:
            # Only the quorum request's own failure is the lighthouse's; an exception from the
            # caller's load_state_dict (applied here when healing) is re-raised as it is.
            future = self._quorum_future  # torchft 0.2.0's handle on the quorum request
            if future is None or not future.done() or future.exception() is not e:
                raise
            seconds = self._quorum_timeout.total_seconds()  # the configured wait, not this call's rest
            raise QuorumFault(quorum_failure_line(self.lighthouse, self.replica_label, seconds, e)) from e


def quorum_failure_line(lighthouse: str, replica: str, timeout_s: float, error: BaseException,
                        detail: str = "") -> str:
    """One line: what failed, where, and what to check. detail: what the quorum lacked."""
    if isinstance(error, TimeoutError):
        return (f"fault_tolerance: no quorum from the lighthouse at {lighthouse} within {timeout_s:g} s "
                f"({replica}{'; ' + detail if detail else ''}): too few replica groups joined (see the "
                f"lighthouse's --min_replicas) or it is unreachable; start the missing groups or raise "
                f"fault_tolerance.quorum_timeout_s.")
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (f"fault_tolerance: no quorum from the lighthouse at {lighthouse} ({replica}): {reason}; check that "
            f"the lighthouse runs there and is reachable.")


def replica_label(replica_id: int, group_size: int) -> str:
    """torchft's replica id: zero-padded so the lighthouse's order (it sorts the ids as text) is
    the numeric one, and ending in digits, which torchft reads back as the group's number."""
    return f"replica_{replica_id:0{len(str(group_size - 1))}d}"


def manager_port(config: FaultToleranceConfig, store_port: int) -> int:
    """The port rank 0's manager server binds: configured, $TORCHFT_MANAGER_PORT, else 0 (any
    free port). Refused when it is the group's own store port (torchrun's MASTER_PORT)."""
    port = config.manager_port
    if port is None:
        port = int(os.environ.get(MANAGER_PORT_ENV, "0"))
    if port != 0 and port == store_port:
        raise ConfigError(f"fault_tolerance.manager_port = {port} is the replica group's store port "
                          f"(MASTER_PORT): pick another port, or 0 for any free one.")
    return port


def start_manager(config: FaultToleranceConfig, state_dict: Callable[[], Any],
                  load_state_dict: Callable[[Any], None], *, rank: int, world_size: int, store_addr: str,
                  store_port: int, process_group_kind: str) -> QuorumManager:
    """Connect this rank to its group's manager (rank 0 starts it and joins the lighthouse).

    The quorum is synchronous (`use_async_quorum=False`): a (re)joining group loads the peer's
    state before its forward, so the data position it reads is already the peer's, and it takes
    part in that same step; DiLoCo needs it too. The quorum is then not overlapped with the forward.
    """
    label = replica_label(config.replica_id, config.group_size)
    timeout = timedelta(seconds=config.timeout_s)
    try:
        manager = QuorumManager(
            pg=replicate_process_group(process_group_kind, timeout),
            load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=config.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timedelta(seconds=config.connect_timeout_s),
            rank=rank, world_size=world_size, store_addr=store_addr, store_port=store_port,
            lighthouse_addr=config.lighthouse, replica_id=label, port=manager_port(config, store_port),
            init_sync=config.init_sync,
        )
    except RuntimeError as e:
        if str(config.lighthouse) not in str(e):
            raise
        raise QuorumFault(quorum_failure_line(str(config.lighthouse), label, config.connect_timeout_s, e)) from e
    manager.lighthouse = str(config.lighthouse)
    manager.replica_label = label
    return manager
