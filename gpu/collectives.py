"""Which collectives gloo runs natively on CUDA tensors with this machine's torch, and that plait's
host staging (plait.mesh.host_staging) fixes the rest: the lease's first stage.

    python gpu/collectives.py --json OUT/collectives.jsonl              two ranks on one GPU
    python gpu/collectives.py --json OUT/collectives.jsonl --device cpu the same on CPU (the dry run)

Each operation runs on tensors of the device and its result is checked against the value computed
locally: `ok`, `wrong` (it ran and returned something else: an op gloo ignores), `error: ...` (it
raised), `crashed` (a rank died: gloo handed a device pointer to its transport) or `timeout`. A
crash costs only that operation: the ranks start again from the next one. Then every operation
plait stages through host memory runs staged. One JSON line per operation and way.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
# name -> (dtype, staged by plait): plait stages point-to-point; the rest it leaves to gloo.
OPS = {
    "all_reduce sum": ("float32", False),
    "all_reduce sum bf16": ("bfloat16", False),
    "all_reduce avg": ("float32", False),
    "broadcast": ("float32", False),
    "all_gather_into_tensor": ("float32", False),
    "all_gather_into_tensor uint8 (float8 bytes)": ("uint8", False),
    "reduce_scatter_tensor sum": ("float32", False),
    "reduce_scatter_tensor avg": ("float32", False),
    "all_to_all_single uneven splits": ("float32", False),
    "isend / irecv": ("float32", True),
    "send / recv": ("float32", True),
}


def _data(rank: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    return (torch.arange(n) % 7 + 10 * rank + 1).to(dtype).to(device)


def _run_op(name: str, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the op returned on this rank, what it should have)."""
    dtype = getattr(torch, OPS[name][0])
    x, peer = _data(rank, 8, dtype, device), 1 - rank
    every = [_data(r, 8, dtype, device) for r in range(WORLD)]
    total = sum(t.double() for t in every).to(dtype)
    if name.startswith("all_reduce"):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.AVG if "avg" in name else dist.ReduceOp.SUM)
        return out, (total.double() / WORLD).to(dtype) if "avg" in name else total
    if name == "broadcast":
        out = x.clone()
        dist.broadcast(out, src=0)
        return out, every[0]
    if name.startswith("all_gather"):
        out = torch.empty(8 * WORLD, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, x)
        return out, torch.cat(every)
    if name.startswith("reduce_scatter"):
        out = torch.empty(8 // WORLD, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.AVG if "avg" in name else dist.ReduceOp.SUM)
        want = total.chunk(WORLD)[rank]
        return out, want / WORLD if "avg" in name else want
    if name.startswith("all_to_all"):
        splits = [[1, 7], [5, 3]]  # splits[src][dst]: rows src sends to dst
        out = torch.empty(sum(splits[src][rank] for src in range(WORLD)), dtype=dtype, device=device)
        dist.all_to_all_single(out, x, [splits[src][rank] for src in range(WORLD)], splits[rank])
        want = torch.cat([every[src].split(splits[src])[rank] for src in range(WORLD)])
        return out, want
    got = torch.zeros_like(x)
    if name == "isend / irecv":
        works = [dist.isend(x, peer), dist.irecv(got, peer)] if rank == 0 else [dist.irecv(got, peer), dist.isend(x, peer)]
        for work in works:
            work.wait()
    elif rank == 0:
        dist.send(x, peer)
        dist.recv(got, peer)
    else:
        dist.recv(got, peer)
        dist.send(x, peer)
    return got, every[peer]


def _rank(rank: int, store_path: str, device_kind: str, names: list[str], progress: str) -> None:
    """Each of `names` in turn ("native NAME", then "staged NAME" once plait's staging is on)."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    for name in names:
        way, op = name.split(" ", 1)
        if way == "staged":
            from plait.mesh.host_staging import install_host_staging

            install_host_staging(stage_cpu=device_kind == "cpu")
        with open(progress, "a") as f:
            f.write(json.dumps({"rank": rank, "op": name, "state": "started"}) + "\n")
        try:
            out, want = _run_op(op, rank, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            result = "ok" if torch.equal(out.cpu(), want.cpu()) else f"wrong: {out.cpu().tolist()} != {want.cpu().tolist()}"
        except Exception as e:  # noqa: BLE001 (recorded, then the next op)
            result = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        with open(progress, "a") as f:
            f.write(json.dumps({"rank": rank, "op": name, "state": result}) + "\n")
    dist.destroy_process_group()


def _spawn(device: str, names: list[str], timeout: float) -> dict[str, str]:
    """Run `names` in order on two fresh ranks; on a crash or a hang, start again after that op."""
    outcome: dict[str, str] = {}
    ctx = mp.get_context("spawn")
    while len(outcome) < len(names):
        todo = [n for n in names if n not in outcome]
        with tempfile.TemporaryDirectory() as tmp:
            progress = os.path.join(tmp, "progress.jsonl")
            procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), device, todo, progress))
                     for r in range(WORLD)]  # fmt: skip
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
            hung = any(p.is_alive() for p in procs)
            codes = [p.exitcode for p in procs]
            for p in procs:
                p.kill()
                p.join(5)
            lines = [json.loads(line) for line in Path(progress).read_text().splitlines()] if os.path.exists(progress) else []
        done = {}
        for line in lines:
            if line["state"] != "started":
                done.setdefault(line["op"], {})[line["rank"]] = line["state"]
        for name in todo:
            states = done.get(name, {})
            if len(states) == WORLD:
                outcome[name] = next((s for s in states.values() if s != "ok"), "ok")
                continue
            outcome[name] = "timeout" if hung else f"crashed (exit codes {codes})"
            break  # the ops after it start again on fresh ranks
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="append one JSON line per operation and way")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per start of the two ranks")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu/collectives.py: no CUDA device: nothing probed (--device cpu for the dry run).")
        return 0
    names = list(OPS)
    # Native first; the staged ones last, in the same ranks (staging, once on, stays on).
    outcome = _spawn(args.device, [f"native {n}" for n in names] + [f"staged {n}" for n in names if OPS[n][1]],
                     timeout=args.timeout)  # fmt: skip
    native = {n: outcome[f"native {n}"] for n in names}
    staged = {n: outcome[f"staged {n}"] for n in names if OPS[n][1]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with args.json.open("a") as f:
        for name in names:
            record = {"op": name, "dtype": OPS[name][0], "device": args.device, "torch": torch.__version__,
                      "native": native[name], "staged_by_plait": OPS[name][1], "staged": staged.get(name)}  # fmt: skip
            f.write(json.dumps(record) + "\n")
            print(f"{name:45s} native {native[name]:40s} staged {staged.get(name) or '-'}")
    failed = [n for n in names if (staged.get(n) or native[n]) != "ok"]
    print(f"gpu/collectives.py: {len(names) - len(failed)} of {len(names)} run correctly on {args.device} tensors "
          f"(natively or staged by plait){'; not: ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
