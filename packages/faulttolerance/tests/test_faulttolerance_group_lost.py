"""A replica group SIGKILLed mid-step: the other keeps stepping with no restart and no checkpoint
read; the killed group restarted takes the live state from it, and both end equal.

Two groups of one rank each, processes; an in-process lighthouse (min_replicas 1, heartbeat
timeout 1 s). Group 1 kills itself at step 2 after its backward, before the gradient average.
"""

from __future__ import annotations

import pytest
import torch
from ft_harness import kill_all, logs, read_json, reference, spawn_group, wait_all, wait_for

from plait.faulttolerance import start_lighthouse

pytestmark = pytest.mark.timeout(150)
KILL_AT = 2


def _shards(entry: dict) -> list[int]:
    return [0, 1] if entry["participants"] == 2 else [0]


def test_group_lost_then_rejoins(tmp_path):
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=1000)
    base = {"lighthouse": lighthouse.address(), "barrier": ["ready_g0_0", "ready_g1_0"], "init_sync": False}
    procs = []
    try:
        procs += spawn_group({**base, "name": "g0", "replica_id": 0, "role": "stayer"}, tmp_path)
        killed = spawn_group({**base, "name": "g1", "replica_id": 1, "role": "joiner", "kill_at_step": KILL_AT},
                             tmp_path)
        procs += killed
        assert wait_all(killed, 60) == [-9], logs(tmp_path)
        wait_for(lambda: (read_json(tmp_path / "progress_g0.json") or {}).get("alone_commits", 0) >= 2, 60,
                 "group 0 to step alone")
        procs += spawn_group({**base, "name": "g1b", "replica_id": 1, "role": "joiner", "barrier": []}, tmp_path)
        assert wait_all(procs, 90) == [0, -9, 0], logs(tmp_path)
    finally:
        kill_all(procs)
        lighthouse.shutdown()

    g0 = torch.load(tmp_path / "result_g0_0.pt", weights_only=False)
    joiner = torch.load(tmp_path / "result_g1b_0.pt", weights_only=False)
    log = g0["log"]
    # Steps 0, 1 with both; step 2 lost with group 1 (not committed), then alone, then both again.
    assert [e["participants"] for e in log[:3]] == [2, 2, 2]
    assert [e["committed"] for e in log[:3]] == [True, True, False]
    assert log[3]["participants"] == 1 and log[3]["position"] == KILL_AT
    assert log[-1]["participants"] == 2 and all(e["committed"] for e in log[3:])
    assert g0["loads"] == [], "group 0 never loads a state: no restart, no checkpoint read"
    assert all(e["writer"] for e in log), "replica 0 is the lowest id in every quorum: it writes"

    # Group 0's parameters: the single-process replay of the shards each committed step averaged.
    expected = reference([_shards(e) for e in log if e["committed"]])
    torch.testing.assert_close(g0["full"], expected, rtol=1e-5, atol=1e-6)

    # The restarted group took the live state (model, Adam, extra) at the step it joined.
    joined = joiner["log"][0]
    assert joined["recovered"] and joined["participants"] == 2
    assert joiner["loads"] == [{"position": joined["position"], "step": joined["position"]}]
    assert not any(e["writer"] for e in joiner["log"])
    torch.testing.assert_close(joiner["full"], g0["full"], rtol=0, atol=0)
    torch.testing.assert_close(joiner["optim"], g0["optim"], rtol=0, atol=0)
    assert joiner["extra"] == g0["extra"]
