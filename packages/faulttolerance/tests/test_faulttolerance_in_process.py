"""Replica groups of one rank as threads of this process (no process start-up to pay): the
per-step average equals the single-process step, LocalSGD and DiLoCo equal their replays, and a
quorum that does not form fails in one line naming the lighthouse.

A group of one rank needs no torch.distributed world: rank, world size and its store are given.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ft_harness import LR, live_state, reference, shard_loss, tiny_model, train_step
from torch.distributed import TCPStore

from plait.faulttolerance import FaultToleranceConfig, QuorumFault, ReplicaGroup, semi_sync, start_lighthouse

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
_model_lock = threading.Lock()  # the threads share torch's seeded generator


def _group_thread(replica_id: int, lighthouse: str, steps: int, optimizer_cls=torch.optim.Adam, **settings) -> dict:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with _model_lock:
        model = tiny_model()
    optimizer = optimizer_cls(model.parameters(), lr=LR)
    extra, loads = {"position": 0, "step": 0}, []
    settings = {"timeout_s": 10, "quorum_timeout_s": 20, "connect_timeout_s": 10, **settings}
    config = FaultToleranceConfig(replica_id=replica_id, group_size=2, lighthouse=lighthouse, **settings)
    group = ReplicaGroup(config, *live_state(model, optimizer, extra, loads), rank=0, world_size=1,
                         store_addr="127.0.0.1", store_port=store.port)
    try:
        if config.semi_sync is None:
            log = [train_step(group, model, optimizer, extra, replica_id) for _ in range(steps)]
        else:
            with semi_sync(group, model, optimizer):
                log = [train_step(group, model, optimizer, extra, replica_id) for _ in range(steps)]
        return {"log": log, "params": model.state_dict(), "participants": group.participants, "step": group.step}
    finally:
        group.shutdown()


def _two_groups(steps: int, **settings) -> list[dict]:
    lighthouse = start_lighthouse(min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_group_thread, r, lighthouse.address(), steps, **settings) for r in range(2)]
            return [f.result(timeout=50) for f in futures]
    finally:
        lighthouse.shutdown()


def test_two_groups_average_gradients_like_one_process():
    results = _two_groups(steps=4)
    expected = reference([[0, 1]] * 4)
    for r in results:
        assert [e["participants"] for e in r["log"]] == [2, 2, 2, 2] and r["step"] == 4
        torch.testing.assert_close(r["params"], expected, rtol=1e-5, atol=1e-6)
    assert [r["log"][-1]["writer"] for r in results] == [True, False]


def _local_runs(sync) -> list[torch.nn.Module]:
    """Each group's Adam on its own shard for 4 steps; `sync(models)` after steps 2 and 4."""
    models = [tiny_model() for _ in range(2)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    for position in range(4):
        for shard, (m, o) in enumerate(zip(models, optimizers)):
            shard_loss(m, shard, position).backward()
            o.step()
            o.zero_grad()
        if position % 2 == 1:
            sync(models)
    return models


@torch.no_grad()
def _average_parameters(models) -> None:
    for ps in zip(*(m.parameters() for m in models)):
        mean = sum(ps) / len(ps)
        for p in ps:
            p.copy_(mean)


def _diloco_sync():
    """DiLoCo's outer step: Nesterov SGD on the mean pseudo-gradient, from the last synced point."""
    outer_model = tiny_model()
    outer = torch.optim.SGD(outer_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    @torch.no_grad()
    def sync(models):
        for g, *ps in zip(outer_model.parameters(), *(m.parameters() for m in models)):
            g.grad = sum(g - p for p in ps) / len(ps)
        outer.step()
        outer.zero_grad()
        for m in models:
            m.load_state_dict(outer_model.state_dict())

    return sync


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_semi_sync_equals_replay(method):
    results = _two_groups(steps=4, semi_sync=method, sync_steps=2, init_sync=False)
    expected = _local_runs(_average_parameters if method == "local_sgd" else _diloco_sync())
    for r, m in zip(results, expected):
        assert r["participants"] == 2 and r["step"] == 2, "two syncs, both groups in each"
        torch.testing.assert_close(r["params"], m.state_dict(), rtol=1e-5, atol=1e-6)


def test_local_sgd_syncing_every_step_is_synchronous_training():
    """With plain SGD, averaging the parameters after every local step is averaging the gradients
    before it: LocalSGD with sync_steps 1 is the synchronous run."""
    results = _two_groups(steps=4, semi_sync="local_sgd", sync_steps=1, init_sync=False, optimizer_cls=torch.optim.SGD)
    expected = reference([[0, 1]] * 4, optimizer_cls=torch.optim.SGD)
    for r in results:
        assert r["participants"] == 2 and r["step"] == 4, "four syncs, both groups in each"
        torch.testing.assert_close(r["params"], expected, rtol=1e-5, atol=1e-6)


def _alone(lighthouse: str, **settings) -> None:
    _group_thread(0, lighthouse, steps=1, **{"quorum_timeout_s": 1.0, "connect_timeout_s": 1.0, **settings})


def test_quorum_timeout_names_the_lighthouse():
    lighthouse = start_lighthouse(min_replicas=2)
    try:
        with pytest.raises(QuorumFault) as lighthouse_waits:
            _alone(lighthouse.address())
        lighthouse_min1 = start_lighthouse(min_replicas=1)
        with pytest.raises(QuorumFault) as too_few:  # the lighthouse allows 1, the config wants 2
            # 3 s: room for the first quorum's answer on a loaded machine (1 s ran out inside it).
            _alone(lighthouse_min1.address(), min_replicas=2, quorum_timeout_s=3.0)
        lighthouse_min1.shutdown()
    finally:
        lighthouse.shutdown()
    for raised, address in ((lighthouse_waits, lighthouse.address()), (too_few, lighthouse_min1.address())):
        message = str(raised.value)
        assert "\n" not in message and address in message and "no quorum" in message, message
    assert "min_replicas = 2" in str(too_few.value)
    with pytest.raises(QuorumFault) as unreachable:
        _alone("http://127.0.0.1:9")
    assert "\n" not in str(unreachable.value) and "http://127.0.0.1:9" in str(unreachable.value)
