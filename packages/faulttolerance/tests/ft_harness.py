"""What the tests share: a tiny model, data by (shard, position), one training step through a
ReplicaGroup, the single-process reference, and starting replica groups as processes.

Data is addressed by (global shard index, data position): the position is the number of committed
steps, so a step that is not committed is retried on the same batch, and a reference that knows
which shards took part in each committed step replays the run in one process.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import torch
from torch import nn

LR = 0.01


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(shard: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * shard + position)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def shard_loss(model: nn.Module, shard: int, position: int) -> torch.Tensor:
    x, y = batch(shard, position)
    return nn.functional.mse_loss(model(x), y)


def train_step(group, model, optimizer, extra: dict, shard: int, before_average=None) -> dict:
    """One step as the trainer makes it; returns the step's log entry."""
    quorum = group.begin_step()
    position = extra["position"]
    shard_loss(model, shard, position).backward()
    if before_average is not None:
        before_average(group)
    group.average_gradients(model.parameters())
    committed = group.should_commit()
    if committed:
        optimizer.step()
        extra["position"] += 1
        extra["step"] = group.step
    optimizer.zero_grad()
    return {"position": position, "participants": quorum.participants, "committed": committed,
            "recovered": quorum.recovered, "writer": group.should_save_checkpoint()}


def live_state(model, optimizer, extra: dict, loads: list):
    """The state_dict / load_state_dict pair a group hands to ReplicaGroup."""
    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": dict(extra)}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        extra.update(state["extra"])
        loads.append(dict(state["extra"]))

    return state_dict, load_state_dict


def reference(shards_per_step: list[list[int]], optimizer_cls=torch.optim.Adam) -> dict[str, torch.Tensor]:
    """One process, one model: each committed step averages the gradient of the shards that took
    part (the loss mean over them) and steps the optimizer (Adam), as the groups did together."""
    model = tiny_model()
    optimizer = optimizer_cls(model.parameters(), lr=LR)
    for position, shards in enumerate(shards_per_step):
        loss = sum(shard_loss(model, s, position) for s in shards) / len(shards)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_forkserver = multiprocessing.get_context("forkserver")
# The fork server imports torch, torchft and plait.faulttolerance once; every group process is a
# fork of it (a fresh interpreter would pay those imports per process: seconds each on 2 cores).
# Python 3.11's fork server does not take the parent's sys.path, so it preloads installed modules
# only (torch._dynamo: what Adam's first construction pulls in); each child imports ft_worker.
_forkserver.set_forkserver_preload(["pytest", "torch", "torch._dynamo", "torch.distributed.fsdp",
                                    "torchft.manager", "torchft.local_sgd", "plait.faulttolerance"])


def spawn_group(spec: dict, workdir: Path, ranks: int = 1) -> list:
    """Start one replica group as `ranks` processes, as torchrun would (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT: the group's own store). Output goes to workdir/<name>_<rank>.log."""
    path = workdir / f"{spec['name']}.json"
    path.write_text(json.dumps({**spec, "workdir": str(workdir)}))
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        log = str(workdir / f"{spec['name']}_{rank}.log")
        procs.append(_forkserver.Process(target=_run_rank, args=(str(path), env, log), daemon=True))
        procs[-1].start()
    return procs


def _run_rank(spec_path: str, env: dict, log: str) -> None:
    import ft_worker

    ft_worker.run_rank(spec_path, env, log)


def wait_all(procs: list, timeout_s: float) -> list[int]:
    """Exit codes (-9: SIGKILL); every process still running at the deadline is killed (the test
    then fails on its code)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.1))
    kill_all(procs)
    return [p.exitcode for p in procs]


def kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("*.log")))
