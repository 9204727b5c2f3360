"""Where a training step's time goes, from one rank's torch.profiler Chrome trace.

`plait-train --metrics.profile_interval N` writes `<dump>/profile/step{N}_rank{R}.json` (CPU
activities). Events on each thread nest by time; an op's self time is its duration minus its
children's. Every microsecond of the profiled step (`ProfilerStep#N`) is put in one category:

  attention       scaled-dot-product / flash attention ops and everything they call
  matmul          mm, addmm, bmm, grouped_mm, ... outside attention
  elementwise     every other aten op (norms, activations, casts, copies, indexing, ...)
  compiled        inductor-generated code (self time of compiled regions): on CPU this is where
                  inductor's C++ kernels run, called from the generated wrapper with no profiler
                  op of their own (`## Call CompiledFxGraph ...` spans' self time; a stack trace
                  put 192 of 225 ms of it inside those kernels, DeepSeek-V3 debug compiled, fp32;
                  on CUDA it is the host launching the graph's Triton kernels)
  communication   c10d collectives and FSDP's waits for them on the training thread (exposed)
  optimizer       everything under Optimizer.step / zero_grad
  python          time in the step that is inside no op: Python, hooks, the framework itself

Collectives that run on another thread (gloo's worker) are summed separately as the total time
the network was busy, so `exposed / total` says how much of it the step waited for.

A CUDA trace (plait-train's or torchtitan's, as benchmarks/gpu.py profiles them): `step_profile`
gives each profiled step's host launch time and GPU busy time, per step (its docstring).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

CATEGORIES = ("attention", "matmul", "elementwise", "compiled", "communication", "optimizer", "python")
# Time spent in kernels (what a faster framework could not remove with these kernels; the optimizer
# counted whole, which makes the bound conservative).
KERNELS = ("attention", "matmul", "elementwise", "compiled", "optimizer")
_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::addbmm",
           "aten::_weight_int8pack_mm", "aten::_scaled_mm"}  # fmt: skip
# Collective ops (everything under them is the collective's own work).
_COLLECTIVES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms", "aten::wait_tensor")
# FSDP's own spans around its collectives: their self time is launching and waiting for them
# (post_backward_reduce: on gloo a synchronous reduce-scatter is waited on inside it, in no op).
_FSDP_COMM_WORDS = ("all_gather", "reduce_scatter", "all_reduce", "_wait", "post_backward_reduce", "rs_wait")
_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_COMPILED_WORDS = ("CompiledFunction", "CompiledFxGraph", "Torch-Compiled Region", "inductor", "triton_", "cpp_fused")


def _is_comm(name: str) -> bool:
    return name.startswith(_COLLECTIVES)


def _category(name: str, ancestors: list[str]) -> str:
    chain = [*ancestors, name]
    if any(a.startswith(("Optimizer.step", "Optimizer.zero_grad")) for a in chain):
        return "optimizer"
    if any(_is_comm(a) for a in chain):
        return "communication"
    if name.startswith("FSDP::") and any(word in name for word in _FSDP_COMM_WORDS):
        return "communication"
    if any(word in a for a in chain for word in _ATTENTION_WORDS):
        return "attention"
    if name in _MATMUL:
        return "matmul"
    if any(word in name for word in _COMPILED_WORDS):
        return "compiled"
    if name.startswith("aten::") or name.startswith("prims::"):
        return "elementwise"
    return "python"  # user annotations (FSDP hooks, ProfilerStep itself): Python running between ops


def _spans_and_steps(trace_path: Path) -> tuple[list[dict], list[dict]]:
    """A Chrome trace's complete spans, and the host's ProfilerStep# ones among them (not their
    copies on a CUDA trace's device timeline, `gpu_user_annotation`; a `.gz` trace, as torchtitan
    writes them, is read through gzip)."""
    with (gzip.open if Path(trace_path).suffix == ".gz" else open)(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#") and not e.get("cat", "").startswith("gpu_")]
    return spans, steps


def _in_step(spans: list[dict], step: dict) -> list[dict]:
    """The spans that start and end inside the profiled step."""
    begin, end = step["ts"], step["ts"] + step["dur"]
    return [e for e in spans if e["ts"] >= begin and e["ts"] + e["dur"] <= end + 1]


def _with_ancestors(thread_spans: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each span of one thread, in start order, with the spans it nests in (outermost first)."""
    nested, stack = [], []
    for e in sorted(thread_spans, key=lambda e: (e["ts"], -e["dur"])):
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        nested.append((e, list(stack)))
        stack.append(e)
    return nested


def summarize(trace_path: Path) -> dict:
    """{"step_ms", "<category>_ms" for each category, "comm_total_ms", "top_ops": [(name, ms)]}."""
    spans, steps = _spans_and_steps(trace_path)
    if not steps:
        raise ValueError(f"{trace_path}: no ProfilerStep# span")
    step = max(steps, key=lambda e: e["dur"])
    by_thread: dict = defaultdict(list)
    for e in _in_step(spans, step):
        by_thread[e["tid"]].append(e)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[str, float] = defaultdict(float)
    comm_other_threads = 0.0
    for tid, thread_events in by_thread.items():
        nested = _with_ancestors(thread_events)
        parents = {id(e): [a["name"] for a in ancestors] for e, ancestors in nested}
        if tid != step["tid"]:
            # Another thread: only collectives matter (time the network was busy, maybe hidden).
            comm_other_threads += sum(
                e["dur"] for e, _ in nested if _is_comm(e["name"]) and not any(map(_is_comm, parents[id(e)]))
            )
            continue
        self_time = {id(e): float(e["dur"]) for e, _ in nested}
        for e, ancestors in nested:
            if ancestors:
                self_time[id(ancestors[-1])] -= e["dur"]
        for e, _ in nested:
            category = _category(e["name"], parents[id(e)])
            totals[category] += self_time[id(e)]
            if category != "python":
                # One entry for every compiled graph's generated code (their names carry a hash).
                name = "inductor code (CompiledFxGraph)" if "CompiledFxGraph" in e["name"] else e["name"]
                per_op[name] += self_time[id(e)]
    summary = {"step_ms": step["dur"] / 1e3, **{f"{c}_ms": totals[c] / 1e3 for c in CATEGORIES}}
    summary["comm_total_ms"] = max(comm_other_threads, totals["communication"]) / 1e3
    summary["top_ops"] = sorted(((n, t / 1e3) for n, t in per_op.items()), key=lambda x: -x[1])[:6]
    return summary


# The CUDA runtime / driver calls in which the host waits for the device: the sync calls, and the
# copies (a copy to pageable host memory returns only when the stream's earlier work is done).
_WAITS = ("Synchronize", "cudaMemcpy", "cuMemcpy")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCHES = ("cuda_runtime", "cuda_driver")


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _step_figures(step: dict, launches: list[dict], device: dict[int, list[dict]]) -> tuple[dict, list[dict]]:
    """One ProfilerStep span: its host and GPU times in µs (see step_profile), and its device events."""
    begin, end = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in launches if begin <= e["ts"] < end]
    waits = [(max(e["ts"], begin), min(e["ts"] + e["dur"], end)) for e in inside if any(w in e["name"] for w in _WAITS)]
    ids = {e["args"]["correlation"] for e in inside if "correlation" in e.get("args", {})}
    work = [d for i in sorted(ids) for d in device.get(i, ())]
    spans = [(d["ts"], d["ts"] + d["dur"]) for d in work]
    wait = _union(waits)
    figures = {
        "host_span": float(step["dur"]),
        "host_wait": wait,
        "host_launch": step["dur"] - wait,
        "gpu_busy": _union(spans),
        "gpu_span": (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0,
    }
    return figures, work


def step_profile(trace_path: Path) -> dict | None:
    """Per-step host and GPU time of a CUDA trace's profiled steps (None for a CPU trace: no device
    events), each step taken by itself, then averaged over the steps the trace holds.

    A step is a host ProfilerStep# span. Its GPU work is the kernels, copies and memsets that the
    CUDA calls made inside that span launched (matched by the profiler's correlation ids, from
    every host thread: autograd's backward thread launches too), wherever they ran on the device's
    timeline; none of another step. Per step:

      host_launch_ms  the span less the time the host was blocked in a CUDA call that waits for
                      the device (*Synchronize*, memcpy): Python, dispatch and launches
      host_wait_ms    that blocked time (overlaps across threads counted once)
      host_span_ms    the whole ProfilerStep span
      gpu_busy_ms     the union of the step's device intervals (time the GPU ran this step's work)
      gpu_span_ms     its first device event's start to its last one's end

    host_launch_ms near the step's wall time: host-bound; gpu_busy_ms near it: GPU-bound. In the
    trainer's trace a step span opens with the previous step's metrics flush (its host sync and a
    few small kernels) and ends before its own flush; torchtitan's ends after its own loss read.
    """
    spans, steps = _spans_and_steps(trace_path)
    device: dict[int, list[dict]] = defaultdict(list)
    for e in spans:
        if e.get("cat") in _DEVICE and "correlation" in e.get("args", {}):
            device[e["args"]["correlation"]].append(e)
    if not device or not steps:
        return None
    launches = sorted((e for e in spans if e.get("cat") in _LAUNCHES), key=lambda e: e["ts"])
    measured = [(f, work) for f, work in (_step_figures(s, launches, device) for s in steps) if work]
    if not measured:
        return None
    n = len(measured)
    per_kernel: dict[str, float] = defaultdict(float)
    for _, work in measured:
        for e in work:
            per_kernel[e["name"][:60]] += e["dur"] / n / 1e3
    return {
        **{f"{key}_ms": sum(f[key] for f, _ in measured) / n / 1e3 for key in measured[0][0]},
        "device_events": sum(len(work) for _, work in measured) / n,
        "steps": n,
        "top_kernels": sorted(per_kernel.items(), key=lambda x: -x[1])[:5],
    }


def kernel_ms(summary: dict) -> float:
    return sum(summary[f"{c}_ms"] for c in KERNELS)


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:]:
        s = summarize(Path(path))
        print(path, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in s.items()})
        steps = step_profile(Path(path))
        if steps:
            print(path, "per step:", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in steps.items()})
