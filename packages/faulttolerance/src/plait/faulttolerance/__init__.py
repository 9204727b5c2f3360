"""plait.faulttolerance: replica groups over the replicate axis with torchft.

Each replica group is its own torchrun job (its own FSDP / TP / CP / EP / PP inside); the replicate
axis across groups is a torchft process group. A lost group drops out of the gradient average and
the rest keep stepping; a (re)joining group loads the live state of a peer. `ReplicaGroup` is the
per-step API, `semi_sync` wraps LocalSGD / DiLoCo, `data_shard` says which data a rank reads.
"""

import os

# torchft's lighthouse and managers (Rust) log every quorum and commit vote at INFO: several lines
# per step and group. Warnings and errors only, unless the user asks for more (RUST_LOG=info).
os.environ.setdefault("RUST_LOG", "warn")

# After RUST_LOG: torchft reads it when it loads.
from .config import PROCESS_GROUPS, SEMI_SYNC_METHODS, FaultToleranceConfig, config_problem  # noqa: E402
from .data_shard import DataShard, data_shard  # noqa: E402
from .errors import QuorumFault  # noqa: E402
from .lighthouse import start_lighthouse  # noqa: E402
from .replica_group import QuorumInfo, ReplicaGroup  # noqa: E402
from .semi_sync import outer_optimizer, semi_sync  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "PROCESS_GROUPS",
    "SEMI_SYNC_METHODS",
    "DataShard",
    "FaultToleranceConfig",
    "QuorumFault",
    "QuorumInfo",
    "ReplicaGroup",
    "config_problem",
    "data_shard",
    "outer_optimizer",
    "semi_sync",
    "start_lighthouse",
]
