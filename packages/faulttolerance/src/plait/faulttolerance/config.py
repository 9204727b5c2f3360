"""The settings of fault-tolerant replica groups, checked before anything connects.

Every refusal is one line naming the setting and the fix, raised as `plait.mesh.errors.ConfigError`
(the trainer exits 2 on it), so a typo fails at start-up instead of as a quorum that never forms.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from plait.mesh.errors import ConfigError

SEMI_SYNC_METHODS = ("local_sgd", "diloco")
PROCESS_GROUPS = ("auto", "gloo", "nccl", "baby_nccl")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def _lighthouse_from_env() -> str | None:
    return os.environ.get(LIGHTHOUSE_ENV) or None


@dataclass
class FaultToleranceConfig:
    """One replica group's view of the job.

    replica_id:       this group's id, 0 <= replica_id < group_size (a restarted group keeps its id).
    group_size:       the most replica groups the job runs; the data is cut into this many parts.
    lighthouse:       the lighthouse's address, `http://HOST:PORT` (default: $TORCHFT_LIGHTHOUSE).
    min_replicas:     fewest groups that may take a step; with fewer, `begin_step` waits for more
                      until `quorum_timeout_s`. Start the lighthouse with the same `--min_replicas`.
    quorum_timeout_s: how long a step waits for a quorum before `QuorumFault` (exit 74).
    timeout_s:        collectives across groups, the commit vote, the live state transfer.
    connect_timeout_s: connecting to the lighthouse and to the group's own manager server.
    semi_sync:        None (average gradients every step), "local_sgd" (average parameters every
                      `sync_steps`) or "diloco" (an outer optimizer step every `sync_steps`).
    sync_steps:       local steps between two syncs under semi_sync.
    outer_lr, outer_momentum, outer_nesterov: DiLoCo's outer SGD (the paper's 0.7, 0.9, Nesterov).
    process_group:    the torchft process group across groups: "auto" (NCCL on CUDA when the group
                      itself runs NCCL, else gloo), "gloo", "nccl" (in process, aborts on error),
                      "baby_nccl" (NCCL in a child process: safer against hangs, ~1 GB more memory).
    init_sync:        at step 0 every group takes the first group's state (leave on unless every
                      group starts from the same checkpoint or seed).
    manager_port:     port of the group's torchft manager server on the group's rank 0
                      (default: $TORCHFT_MANAGER_PORT, else any free port).
    bucket_mb:        size of the flat buffers gradients travel in across groups.
    """

    replica_id: int
    group_size: int
    lighthouse: str | None = field(default_factory=_lighthouse_from_env)
    min_replicas: int = 1
    quorum_timeout_s: float = 60.0
    timeout_s: float = 60.0
    connect_timeout_s: float = 60.0
    semi_sync: str | None = None
    sync_steps: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    process_group: str = "auto"
    init_sync: bool = True
    manager_port: int | None = None
    bucket_mb: float = 25.0

    def validate(self) -> FaultToleranceConfig:
        """Raise ConfigError for the first setting that cannot run; return self."""
        problem = config_problem(self)
        if problem is not None:
            raise ConfigError(problem)
        return self


def config_problem(config: FaultToleranceConfig) -> str | None:
    """The first setting of `config` that cannot run, as one line, or None."""
    for check in (_group_problem, _timeout_problem, _semi_sync_problem, _transport_problem):
        problem = check(config)
        if problem is not None:
            return problem
    return None


def _group_problem(c: FaultToleranceConfig) -> str | None:
    p = "fault_tolerance."
    if c.group_size < 1:
        return f"{p}group_size = {c.group_size} must be at least 1: set it to the number of replica groups you launch."
    if not 0 <= c.replica_id < c.group_size:
        return (f"{p}replica_id = {c.replica_id} must be in [0, group_size = {c.group_size}): start group i with "
                f"--{p}replica_id i.")
    if not c.lighthouse:
        return (f"{p}lighthouse is not set: pass the lighthouse's address (--{p}lighthouse http://HOST:29510) "
                f"or export {LIGHTHOUSE_ENV}.")
    if not 1 <= c.min_replicas <= c.group_size:
        return (f"{p}min_replicas = {c.min_replicas} must be in [1, group_size = {c.group_size}]: a quorum "
                f"larger than the job could never form; lower it or raise group_size.")
    return None


def _timeout_problem(c: FaultToleranceConfig) -> str | None:
    for name in ("quorum_timeout_s", "timeout_s", "connect_timeout_s"):
        if getattr(c, name) <= 0:
            return f"fault_tolerance.{name} = {getattr(c, name)} must be positive (seconds)."
    return None


def _semi_sync_problem(c: FaultToleranceConfig) -> str | None:
    p = "fault_tolerance."
    if c.semi_sync is None:
        return None
    if c.semi_sync not in SEMI_SYNC_METHODS:
        return f"{p}semi_sync = {c.semi_sync!r}: pick one of {', '.join(SEMI_SYNC_METHODS)}, or leave it unset."
    if c.sync_steps < 1:
        return (f"{p}sync_steps = {c.sync_steps} must be at least 1 under semi_sync = {c.semi_sync}: the "
                f"local steps between two syncs.")
    if c.outer_lr <= 0:
        return f"{p}outer_lr = {c.outer_lr} must be positive (DiLoCo's default: 0.7)."
    if not 0 <= c.outer_momentum < 1:
        return f"{p}outer_momentum = {c.outer_momentum} must be in [0, 1) (DiLoCo's default: 0.9)."
    return None


def _transport_problem(c: FaultToleranceConfig) -> str | None:
    p = "fault_tolerance."
    if c.process_group not in PROCESS_GROUPS:
        return f"{p}process_group = {c.process_group!r}: pick one of {', '.join(PROCESS_GROUPS)}."
    if c.manager_port is not None and not 0 <= c.manager_port < 65536:
        return f"{p}manager_port = {c.manager_port} is not a port: use 0..65535 (0: any free port)."
    if c.bucket_mb <= 0:
        return f"{p}bucket_mb = {c.bucket_mb} must be positive."
    return None
