"""A plan from a traced step: memory against the device, communication time, FLOPs and the ideal
step time; printed as a compact table or written as JSON."""

from dataclasses import asdict

from .collectives import wire_factor
from .devices import GIB, Device, link_gb_s

HEADROOM = 0.10  # a plan fits when its peak leaves 10% of the device's memory free


def tokens_per_gpu_per_step(local_batch: int, seq_len: int, accumulation: int, dp: int, world_size: int) -> float:
    """The global batch's tokens per step over the world: local batch x seq_len x accumulation x
    dp / world size (= / (tp x cp x pp)); what the layout search and --plan.max_batch compare."""
    return local_batch * seq_len * accumulation * dp / world_size


def build_report(config, plan, traced, device: Device, device_memory_gib: float, analytic,
                 documents: dict | None = None) -> dict:
    """Everything plait-plan prints, as plain data (the JSON of --plan.json). `documents`: the
    traced rows' documents (cli.documents_per_row)."""
    t, dims = config.training, plan.dims
    documents = documents or {"document_tokens": t.seq_len, "documents_per_row": 1, "source": "one per row"}
    pipe = traced.pipeline or None
    flops, compute_s = _compute(config, plan, pipe, device)
    comm = _communication(traced.collectives, device)
    comm_s = sum(c["seconds"] for c in comm)
    limit = device_memory_gib * GIB * (1 - HEADROOM)
    peak, parts = _steady_peak(traced)
    return {
        "config": f"{config.model.name} {config.model.flavor}",
        "layout": {**asdict(dims), "efsdp": dims.efsdp if dims.ep > 1 else None},
        "micro_batch": [t.local_batch_size, t.seq_len],
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "activation_checkpoint": t.activation_checkpoint,
        "dtype": t.dtype,
        "float8": t.float8,
        "float8_experts": t.float8_experts,
        "kernel_route": "gpu",  # what the step was traced through (trace.gpu_kernel_routes)
        "vocab_size": plan.model_args.vocab_size,
        "documents": documents,
        "memory": {
            "parameters": traced.params, "gradients": traced.grads, "optimizer": traced.optimizer,
            "activations": traced.activations, "logits": traced.logits, "peak": peak, "first_step_peak": traced.peak,
            "peak_at": {"module": traced.peak_module, "phase": traced.peak_phase}, "peak_parts": parts,
        },
        "analytic_estimate": analytic,
        "pipeline": pipe,
        "fits": peak <= limit,
        "device_memory_gib": device_memory_gib,
        "usable_gib": limit / GIB,
        "communication": comm,
        "host_syncs": traced.host_syncs,
        # Ops the step dispatches (each at least one kernel launch on a GPU; plan/host_ops.py), all
        # and those that launch a kernel (views and allocations left out), and per op.
        "host_ops_per_step": traced.host_ops,
        "host_kernel_ops_per_step": traced.host_kernel_ops,
        "host_ops_by_op": traced.host_ops_by_op,
        "flops_per_rank": flops,
        "compute_seconds": compute_s,
        "communication_seconds": comm_s,
        "ideal_step_seconds": max(compute_s, comm_s),
        "serial_step_seconds": compute_s + comm_s,
        "assumptions": _assumptions(config, plan, device, documents, pipe),
    }


def _compute(config, plan, pipe: dict | None, device: Device) -> tuple[float, float]:
    """FLOPs of a rank per step and their time at the device's dense peaks: float8 linears'
    (training.float8) and experts' (training.float8_experts) at its float8 peak, the rest at its
    bf16 peak."""
    from plait.trainer.float8 import float8_flops_per_token

    t, dims = config.training, plan.dims
    # A rank computes 1 / (tp x cp) of each of its sequences (the trainer's metrics count it so);
    # under pp, its stages' share of the blocks.
    tokens_per_rank = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps / (dims.tp * dims.cp)
    share = pipe["blocks"] / pipe["model_blocks"] if pipe else 1.0
    flops = plan.model.flops_per_token(t.seq_len) * tokens_per_rank * share
    experts = list(plan.info.get("experts", ()))
    float8_flops = float8_flops_per_token(plan.model, config, experts) * tokens_per_rank * share
    compute_s = (flops - float8_flops) / (device.bf16_tflops * 1e12)
    compute_s += float8_flops / (device.fp8_tflops * 1e12) if float8_flops else 0.0
    # The pipeline's bubble: idle time of a stage, as a fraction of the step (pipeline.BUBBLE).
    compute_s /= 1 - (pipe["bubble"] if pipe else 0.0)
    return flops, compute_s


def _communication(collectives: dict, device: Device) -> list[dict]:
    """Each traced collective's bytes on the wire and time over its link."""
    comm = []
    for key, row in collectives.items():
        axis, kind = key.split("/")
        wire = row["bytes"] * wire_factor(kind, row["ranks"])
        gb_s = link_gb_s(device, row["span"])
        comm.append({"axis": axis, "kind": kind, "count": row["count"], "bytes": row["bytes"], "ranks": row["ranks"],
                     "link": "nvlink" if gb_s == device.nvlink_gb_s else "ib", "seconds": wire / (gb_s * 1e9)})
    return comm


def _steady_peak(traced) -> tuple[int, dict]:
    """The peak of a step after the first, and its parts."""
    # The traced step is a run's first: AdamW makes its state in that step's optimizer step, so a
    # peak reached in forward or backward had no state alive. From step 2 on it is alive all
    # through (and gradients are freed each step): a later step's peak adds it.
    peak, parts = traced.peak, dict(traced.peak_parts)
    if traced.optimizer and not parts.get("Optstate"):
        peak += traced.optimizer
        parts["Optstate"] = traced.optimizer
    return peak, parts


def _assumptions(config, plan, device: Device, documents: dict, pipe: dict | None) -> list[str]:
    """What the plan's numbers assume, printed under them."""
    t = config.training
    document_mask = getattr(plan.model_args, "attention_mask", "causal") == "document"
    return [
        device.assumptions(),
        "kernels: the GPU's routes (bf16 products and attention in bf16, MLA's attention without padded "
        "values), traced with fake tensors on this CPU whatever its bf16 units",
        f"no tokenizer or dataset read: the model's vocab_size {plan.model_args.vocab_size} sizes the embedding "
        "and logits",
        (f"document mask: {documents['documents_per_row']} documents of {t.seq_len // documents['documents_per_row']}"
         f" tokens per row (mean document length {documents['document_tokens']}: {documents['source']})"
         if document_mask else "causal mask: documents not traced"),
        "FLOPs: the model's flops_per_token (6 x params + attention; activation-checkpoint recompute not counted)",
        "memory: the peak of a step after the first (the first step's traced peak plus the optimizer state "
        "when that peak came before the state existed); torch's MemTracker over one traced step (parameters, gradients, optimizer state, activations, "
        "temporaries); no CUDA context, allocator fragmentation or NCCL buffers",
        "dropless expert parallel: balanced routing (each MoE layer's rows split evenly over the ep ranks)",
        "training.compile is traced eagerly (host ops: the eager step's)",
        *(["host ops: the traced micro-batch's times the accumulation steps, plus the step's once (the later "
           "micro-batches' adds into the held gradients not counted)"] if t.gradient_accumulation_steps > 1 and not pipe
          else []),
        *(["pipeline: one micro-batch traced per stage, the step composed along torch's action order; "
           f"FLOPs: this rank's {pipe['blocks']} of {pipe['model_blocks']} blocks; compute time includes the "
           f"bubble {pipe['bubble_formula']}"] if pipe else []),
    ]


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def format_report(r: dict) -> str:
    m = r["memory"]
    layout = ", ".join(f"{k} {v}" for k, v in r["layout"].items() if k != "world_size" and v not in (None, 1))
    lines = [
        f"plait-plan: {r['config']} on {r['layout']['world_size']} ranks ({layout or 'one rank'}), micro-batch "
        f"{r['micro_batch'][0]} x {r['micro_batch'][1]} x {r['gradient_accumulation_steps']} accumulation, "
        f"AC {r['activation_checkpoint']}, {r['dtype']}",
        "",
        "memory per rank (GiB)        traced  analytic",
    ]
    a = r["analytic_estimate"]
    parts = m["peak_parts"]
    # Parameters alive at the peak beyond this rank's shards: FSDP's gathered (unsharded) units.
    unsharded = max(0, parts.get("Parameter", 0) - m["parameters"]) if parts else None
    rows = [("parameters", m["parameters"], None), ("gradients", m["gradients"], None),
            ("optimizer state", m["optimizer"], None), ("model state (sum)", m["parameters"] + m["gradients"] +
            m["optimizer"], a["model state"]), ("activations (+ logits)", m["activations"], a["activations"] +
            a["logits"]), ("  of which logits", m["logits"], a["logits"]), ("FSDP unsharded units", unsharded,
            a["FSDP unsharded units"]), ("peak", m["peak"], sum(a.values()))]
    for name, traced, analytic in rows:
        lines.append(f"  {name:24s}{_gib(traced) if traced is not None else '       -'}"
                     f"{_gib(analytic) if analytic is not None else '        -'}")
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    lines += [
        f"  peak in {m['peak_at']['module']} ({m['peak_at']['phase']}); {verdict} in {r['device_memory_gib']:.1f} GiB "
        f"with 10% headroom ({r['usable_gib']:.1f} GiB usable)",
        "  at the peak: " + ", ".join(f"{k.lower()} {v / GIB:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
                                      if v) + " GiB",
    ]
    pipe = r.get("pipeline")
    if pipe:
        lines.append(
            f"  pipeline: {pipe['schedule']}, stages {pipe['stages']} of {pipe['num_stages']}, {pipe['microbatches']} "
            f"micro-batches of {pipe['microbatch_rows']} rows, at most {pipe['max_in_flight']} in flight on this rank "
            f"({pipe['in_flight_at_peak']} at the peak), receive buffers {pipe['recv_buffers'] / GIB:.2f} GiB, bubble "
            f"{pipe['bubble']:.1%} ({pipe['bubble_formula']})")
    lines += [
        "",
        "communication per step      count        GiB  link        ms",
    ]
    for c in r["communication"]:
        kind = "send/recv" if c["kind"] == "send_recv" else c["kind"]
        lines.append(f"  {c['axis'] + ' ' + kind:24s}{c['count']:7d} {_gib(c['bytes'])}  {c['link']:6s}"
                     f"{c['seconds'] * 1e3:8.2f}")
    if not r["communication"]:
        lines.append("  none (one rank)")
    lines += [
        "",
        f"FLOPs per rank per step {r['flops_per_rank']:.3e}: compute {r['compute_seconds'] * 1e3:.2f} ms, "
        f"communication {r['communication_seconds'] * 1e3:.2f} ms, ideal step {r['ideal_step_seconds'] * 1e3:.2f} ms "
        f"(no overlap {r['serial_step_seconds'] * 1e3:.2f} ms); host syncs per step {r['host_syncs']}",
        f"host ops per step: {r['host_ops_per_step']} (kernel launches: {r['host_kernel_ops_per_step']}; "
        "eager, one op = one launch or more)",
        "assumptions: " + "; ".join(r["assumptions"]),
    ]
    return "\n".join(lines)
