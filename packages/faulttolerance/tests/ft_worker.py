"""One rank of one replica group, started by ft_harness.spawn_group (`run_rank`, in a process
forked from a server that has imported torch and torchft).

The spec (JSON) says which group, whether to shard with FSDP over the group's ranks, where to
kill itself, and its role when the quorum changes:
  stayer: after a phase alone (quorum 1), the step at which a group joins sets the stop step
          (3 committed steps later), which rank 0 writes to workdir/stop_at.json;
  joiner: stops at the step read from workdir/stop_at.json.
Each rank writes workdir/result_<name>_<rank>.pt: its step log, full and local parameters, its
local optimizer state, the extra state, and what it loaded from a peer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ft_harness import LR, live_state, read_json, tiny_model, train_step, write_json
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from plait.faulttolerance import FaultToleranceConfig, ReplicaGroup, data_shard

PACE_ALONE_S = 0.2  # a group alone slows down while it waits for a joiner
STEP_CAP = 200


def local(t):
    return t.to_local().clone() if isinstance(t, DTensor) else (t.clone() if torch.is_tensor(t) else t)


def barrier(spec: dict, workdir: Path, rank: int) -> None:
    """Both groups' managers exist before either asks for a quorum, so the first has both."""
    (workdir / f"ready_{spec['name']}_{rank}").touch()
    deadline = time.monotonic() + 60
    while not all((workdir / name).exists() for name in spec.get("barrier", [])):
        if time.monotonic() > deadline:
            raise TimeoutError("barrier")
        time.sleep(0.05)


def run(group, model, optimizer, extra, shard, spec, workdir, rank) -> list[dict]:
    kill_at = spec.get("kill_at_step")

    def before_average(g):
        if g.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    entries, seen_alone, stop_at = [], False, None
    while True:
        if spec["role"] == "joiner":
            stop_at = (read_json(workdir / "stop_at.json") or {}).get("step")
        if stop_at is not None and group.step >= stop_at:
            return entries
        if group.step > STEP_CAP:
            raise RuntimeError(f"no joiner within {STEP_CAP} steps")
        entry = train_step(group, model, optimizer, extra, shard, before_average)
        entries.append(entry)
        if entry["participants"] == 1:
            seen_alone = True
            time.sleep(PACE_ALONE_S)
        elif seen_alone and spec["role"] == "stayer" and stop_at is None:
            stop_at = group.step + 3
            if rank == 0:
                write_json(workdir / "stop_at.json", {"step": stop_at})
        if rank == 0:
            alone = sum(e["participants"] == 1 and e["committed"] for e in entries)
            write_json(workdir / f"progress_{spec['name']}.json", {"step": group.step, "alone_commits": alone})


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    workdir = Path(spec["workdir"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model()
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    extra, loads = {"position": 0, "step": 0}, []
    state_dict, load_state_dict = live_state(model, optimizer, extra, loads)
    config = FaultToleranceConfig(replica_id=spec["replica_id"], group_size=2, lighthouse=spec["lighthouse"],
                                  quorum_timeout_s=30, timeout_s=10, connect_timeout_s=10,
                                  init_sync=spec.get("init_sync", True))
    group = ReplicaGroup(config, state_dict, load_state_dict)
    barrier(spec, workdir, rank)
    shard = data_shard(spec["replica_id"], 2, rank, world).index
    entries = run(group, model, optimizer, extra, shard, spec, workdir, rank)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    optim_state = {i: {k: local(v) for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    torch.save({"log": entries, "extra": extra, "loads": loads, "full": full, "optim": optim_state,
                "local": {k: local(v) for k, v in model.state_dict().items()}},
               workdir / f"result_{spec['name']}_{rank}.pt")
    group.shutdown()
    dist.destroy_process_group()


def run_rank(spec_path: str, env: dict, log: str) -> None:
    """The process's environment as torchrun sets it, its output to `log`, then `main`."""
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    main(spec_path)
