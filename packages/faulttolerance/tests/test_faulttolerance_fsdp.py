"""Two replica groups of 2 ranks each, FSDP2 (`fully_shard`) over each group's own ranks: group 0
starts alone, group 1 joins late and takes the live state (sharded parameters, Adam state, extra
state) rank by rank from group 0. Every committed step equals the single-process step averaged
over the shards that took part: group 0's two alone, all four together (a 4-rank HSDP run).
"""

from __future__ import annotations

import pytest
import torch
from ft_harness import kill_all, logs, read_json, reference, spawn_group, wait_all, wait_for

from plait.faulttolerance import start_lighthouse

pytestmark = pytest.mark.timeout(150)


def _shards(entry: dict) -> list[int]:
    return [0, 1, 2, 3] if entry["participants"] == 2 else [0, 1]


def test_fsdp_groups_late_join(tmp_path):
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=1000)
    base = {"lighthouse": lighthouse.address()}
    procs = []
    try:
        procs += spawn_group({**base, "name": "g0", "replica_id": 0, "role": "stayer"}, tmp_path, ranks=2)
        wait_for(lambda: (read_json(tmp_path / "progress_g0.json") or {}).get("alone_commits", 0) >= 2, 60,
                 "group 0 to step alone")
        procs += spawn_group({**base, "name": "g1", "replica_id": 1, "role": "joiner"}, tmp_path, ranks=2)
        assert wait_all(procs, 90) == [0, 0, 0, 0], logs(tmp_path)
    finally:
        kill_all(procs)
        lighthouse.shutdown()

    g0 = [torch.load(tmp_path / f"result_g0_{r}.pt", weights_only=False) for r in range(2)]
    g1 = [torch.load(tmp_path / f"result_g1_{r}.pt", weights_only=False) for r in range(2)]
    log = g0[0]["log"]
    assert log[0]["participants"] == 1 and log[-1]["participants"] == 2
    assert all(e["committed"] for e in log) and g0[0]["loads"] == g0[1]["loads"] == []
    expected = reference([_shards(e) for e in log])
    torch.testing.assert_close(g0[0]["full"], expected, rtol=1e-5, atol=1e-6)

    joined = g1[0]["log"][0]
    assert joined["recovered"] and joined["participants"] == 2 and joined["position"] > 0
    for rank in range(2):
        assert g1[rank]["loads"] == [{"position": joined["position"], "step": joined["position"]}]
        torch.testing.assert_close(g1[rank]["local"], g0[rank]["local"], rtol=0, atol=0)
        torch.testing.assert_close(g1[rank]["optim"], g0[rank]["optim"], rtol=0, atol=0)
        assert g1[rank]["extra"] == g0[rank]["extra"]
    assert all(e["writer"] for e in log) and not any(e["writer"] for e in g1[0]["log"])
