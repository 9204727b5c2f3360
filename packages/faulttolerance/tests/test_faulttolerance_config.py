"""Settings refused in one line naming the setting and the fix, the data partition, and the
small pure helpers (no process, no lighthouse)."""

from __future__ import annotations

import pytest
import torch

from plait.faulttolerance import DataShard, FaultToleranceConfig, data_shard
from plait.faulttolerance.grad_average import gradient_buckets
from plait.faulttolerance.manager import manager_port, replica_label
from plait.faulttolerance.process_group import process_group_kind
from plait.mesh.errors import ConfigError

LIGHTHOUSE = "http://lighthouse:29510"


def _config(**settings) -> FaultToleranceConfig:
    return FaultToleranceConfig(**{"replica_id": 0, "group_size": 2, "lighthouse": LIGHTHOUSE, **settings})


@pytest.mark.parametrize("settings, named", [
    ({"replica_id": 2}, "fault_tolerance.replica_id = 2"),
    ({"replica_id": -1}, "fault_tolerance.replica_id = -1"),
    ({"group_size": 0}, "fault_tolerance.group_size = 0"),
    ({"lighthouse": None}, "fault_tolerance.lighthouse is not set"),
    ({"lighthouse": ""}, "fault_tolerance.lighthouse is not set"),
    ({"min_replicas": 3}, "fault_tolerance.min_replicas = 3"),
    ({"min_replicas": 0}, "fault_tolerance.min_replicas = 0"),
    ({"semi_sync": "diloco", "sync_steps": 0}, "fault_tolerance.sync_steps = 0"),
    ({"semi_sync": "streaming"}, "fault_tolerance.semi_sync = 'streaming'"),
    ({"semi_sync": "diloco", "outer_momentum": 1.0}, "fault_tolerance.outer_momentum = 1.0"),
    ({"semi_sync": "diloco", "outer_lr": 0}, "fault_tolerance.outer_lr = 0"),
    ({"quorum_timeout_s": 0}, "fault_tolerance.quorum_timeout_s = 0"),
    ({"process_group": "mpi"}, "fault_tolerance.process_group = 'mpi'"),
    ({"manager_port": 70000}, "fault_tolerance.manager_port = 70000"),
])
def test_refusals_name_the_setting_in_one_line(settings, named):
    with pytest.raises(ConfigError) as refused:
        _config(**settings).validate()
    message = str(refused.value)
    assert message.startswith(named) and "\n" not in message, message


def test_accepted_settings_and_the_lighthouse_from_the_environment(monkeypatch):
    _config(semi_sync="local_sgd", sync_steps=1).validate()
    _config(sync_steps=0).validate()  # sync_steps only matters under semi_sync
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://from-env:29510")
    assert FaultToleranceConfig(replica_id=1, group_size=2).validate().lighthouse == "http://from-env:29510"


def test_manager_port_never_takes_the_group_store_port(monkeypatch):
    monkeypatch.delenv("TORCHFT_MANAGER_PORT", raising=False)
    assert manager_port(_config(), store_port=29500) == 0
    monkeypatch.setenv("TORCHFT_MANAGER_PORT", "29501")
    assert manager_port(_config(), store_port=29500) == 29501
    with pytest.raises(ConfigError, match="fault_tolerance.manager_port = 29500 is the replica group's store"):
        manager_port(_config(manager_port=29500), store_port=29500)


def test_data_shards_cover_the_data_once():
    shards = [data_shard(r, 3, d, 2) for r in range(3) for d in range(2)]
    assert [s.index for s in shards] == list(range(6)) and {s.count for s in shards} == {6}
    assert data_shard(1, 2, 0, 1) == DataShard(index=1, count=2)
    with pytest.raises(ValueError):
        data_shard(2, 2, 0, 1)


def test_replica_labels_sort_like_their_numbers():
    labels = [replica_label(r, 12) for r in range(12)]
    assert sorted(labels) == labels and labels[3] == "replica_03"


def test_buckets_keep_one_dtype_and_the_size_cap():
    grads = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(100), torch.zeros(2)]
    buckets = gradient_buckets(grads, bucket_bytes=40)
    assert [len(b) for b in buckets] == [2, 1, 1, 1]


def test_process_group_by_device():
    assert process_group_kind("auto", "cpu") == "gloo"
    assert process_group_kind("auto", "cuda") == "nccl"  # no world here: the group is taken to run NCCL
    assert process_group_kind("baby_nccl", "cuda") == "baby_nccl"
