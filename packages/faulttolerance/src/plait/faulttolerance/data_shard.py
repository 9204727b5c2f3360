"""Which part of the data a rank reads when the job is split into replica groups.

The data is cut into `group_size x dp_degree` parts once, by the largest job: every group reads
its own parts whether or not the others are alive, so a lost group's parts are skipped, never
read twice by the groups that keep going (torchft's DistributedSampler makes the same choice).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataShard:
    """Read part `index` of `count` equal parts (e.g. a sampler's rank and num_replicas)."""

    index: int
    count: int


def data_shard(replica_id: int, group_size: int, dp_rank: int, dp_degree: int) -> DataShard:
    """The global part of a rank: groups are outermost, the group's own dp ranks inside.

    dp_rank, dp_degree: the rank's place on the group's own data-parallel view (`meshes.dp`)."""
    if not 0 <= replica_id < group_size:
        raise ValueError(f"replica_id = {replica_id} must be in [0, group_size = {group_size})")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_degree = {dp_degree})")
    return DataShard(index=replica_id * dp_degree + dp_rank, count=group_size * dp_degree)
