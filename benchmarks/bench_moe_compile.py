"""MoE compile A/B on this machine: eager vs compiled per block, the DeepSeek-V3 debug model, 1 rank.

    python benchmarks/bench_moe_compile.py [--rounds 5] [--steps 3] [--batch 2] [--seq 256]
        [--dtypes float32,bfloat16] [--threads 1] [--what model,moe]

`model`: the debugmodel flavor (6 layers, 1 dense + 5 MoE, dim 256, 8 routed experts top-3 + 2
shared), forward + backward of a cross-entropy loss, every block compiled as the trainer does
(`block.compile()`, inductor, fullgraph). `moe`: one MoE block alone (input [batch, seq, 256]).
Dtypes: the whole model cast (bf16 weights and activations; fp32 as the parity matrix runs).
In each round A (eager) and B (compiled) alternate, each timing `--steps` steps after its warm-up
(compile happens before the first round), so a shared machine's drifting load hits both alike;
prints the median step time of each with the range over rounds, and the median B / A ratio.
`--equal-groups` also times the experts alone on capacity mode's equal groups: batched matmul vs
grouped_mm (the choice `GroupedExperts` makes on CPU), forward + backward.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from plait.models.deepseek_v3 import FLAVORS, Transformer
from plait.models.deepseek_v3.model import build_moe


def _timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def _alternate(a: tuple[str, callable], b: tuple[str, callable], rounds: int, steps: int, digits: int) -> str:
    """A and B take turns going first each round, each timing `steps` steps after a warm-up call;
    "A median [range], B median [range], B/A median [range]" in ms."""
    times = {a[0]: [], b[0]: []}
    for r in range(rounds):
        for name, fn in (a, b) if r % 2 == 0 else (b, a):
            fn()  # warm-up of this round (caches, allocator)
            times[name].append(_timed(fn, steps) * 1e3)
    ratios = [y / x for x, y in zip(times[a[0]], times[b[0]])]
    cells = [
        f"{k} {statistics.median(v):.{digits}f} ms [{min(v):.{digits}f}-{max(v):.{digits}f}]" for k, v in times.items()
    ]
    return (", ".join(cells) + f", {b[0]}/{a[0]} {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]")  # fmt: skip


def _cases(what: str, dtype: torch.dtype, batch: int, seq: int):
    """(eager step, compiled step) for one workload."""
    args = FLAVORS["debugmodel"]
    torch.manual_seed(0)
    if what == "model":
        eager, compiled = Transformer(args), Transformer(args)
        for m in (eager, compiled):
            m.init_weights()
        compiled.load_state_dict(eager.state_dict())
        for block in compiled.layers.values():
            block.compile(fullgraph=True)
        tokens = torch.randint(0, args.vocab_size, (batch, seq))

        def step_of(m):
            m = m.to(dtype)

            def step():
                logits = m(tokens)
                F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

            return step
    else:
        eager, compiled_moe = build_moe(args), build_moe(args)
        eager.init_weights(0.02)
        compiled_moe.load_state_dict(eager.state_dict())
        compiled = torch.compile(compiled_moe, fullgraph=True)
        x = torch.randn(batch, seq, args.dim)

        def step_of(m):
            m = m.to(dtype)
            xd = x.to(dtype).requires_grad_()

            def step():
                m(xd).float().square().mean().backward()

            return step

    return step_of(eager), step_of(compiled)


def ab(what: str, dtype: torch.dtype, rounds: int, steps: int, batch: int, seq: int) -> None:
    eager, compiled = _cases(what, dtype, batch, seq)
    t0 = time.perf_counter()
    compiled()
    compiled()
    compile_s = time.perf_counter() - t0
    eager()
    result = _alternate(("eager", eager), ("compiled", compiled), rounds, steps, digits=1)
    print(f"{what} {str(dtype)[6:]} (compile + first steps {compile_s:.0f} s): {result}", flush=True)


def equal_groups(dtype: torch.dtype, rounds: int, steps: int) -> None:
    """Experts alone on equal groups (capacity mode): bmm vs grouped_mm, forward + backward."""
    from plait.models.moe import GroupedExperts

    for E, G, D, H in ((4, 96, 256, 256), (8, 32, 256, 256), (4, 256, 1024, 704)):
        experts = GroupedExperts(D, H, E).to(dtype)
        experts.init_weights(0.02)
        experts.pad_groups = False
        x = torch.randn(E * G, D, dtype=dtype)
        counts = torch.full((E,), G)

        def run(group_rows, experts=experts, x=x, counts=counts):
            xr = x.detach().requires_grad_()
            experts(xr, counts, group_rows=group_rows).float().square().mean().backward()

        result = _alternate(("grouped_mm", lambda: run(None)), ("bmm", lambda run=run, G=G: run(G)), rounds, steps, 2)
        print(f"equal groups E {E} x {G} rows, D {D} H {H} {str(dtype)[6:]}: {result}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--what", default="moe,model")
    parser.add_argument("--equal-groups", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    for dtype in dtypes:
        for what in args.what.split(","):
            if what:
                ab(what, dtype, args.rounds, args.steps, args.batch, args.seq)
        if args.equal_groups:
            equal_groups(dtype, args.rounds, args.steps)


if __name__ == "__main__":
    main()
