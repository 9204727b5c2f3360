"""The order in which `plait-plan --plan.search` traces its candidates (plan/search.py): a rough
analytic figure of the wire bytes per token of a layout, from the model's shape. Every number the
search prints is traced; this one only picks which candidates are traced first."""


def model_shape(model, info) -> dict:
    """What `comm_guess` reads: dense and expert parameters, width, depth, MoE layers, top-k."""
    from torch import nn

    from plait.trainer.memory_estimate import _block_dim, _expert_owner

    experts = info.get("experts", [])
    dense = expert = 0
    for name, p in model.named_parameters():
        if _expert_owner(name.rsplit(".", 1)[0], experts):
            expert += p.numel()
        else:
            dense += p.numel()
    blocks = info.get("blocks", [])
    first = model.get_submodule(blocks[0]) if blocks else model
    moe_layers = sum(1 for b in blocks if any(e.startswith(b + ".") for e in experts))
    top_k = max((getattr(m, "top_k", 1) for m in model.modules() if not isinstance(m, nn.Linear)), default=1)
    return {"dense": dense, "expert": expert, "dim": _block_dim(model, first), "layers": len(blocks),
            "moe_layers": moe_layers, "top_k": top_k}


def comm_guess(c, shape: dict, seq_len: int, act_bytes: int, world_size: int) -> float:
    """Rough wire bytes per token of a rank (ring collectives): FSDP's two gathers and fp32
    reduce-scatter per micro-batch, replicate's fp32 all-reduce per micro-batch (the trainer
    reduces every micro-batch's gradients), TP's four collectives per block
    each way (six forward with full AC's recompute), CP's K/V gather and gradient scatter, EP's four
    all-to-alls per MoE layer; under pp a rank holds 1 / pp of the model, FSDP gathers once per step
    and a micro-batch's hidden state crosses each stage boundary both ways. Orders the traces only.
    `c`: a search.Candidate; `shape`: model_shape's."""
    def ring(n):
        return (n - 1) / n if n > 1 else 0.0

    fsdp = c.dp_shard * c.cp
    tokens = c.local_batch_size * seq_len / c.cp  # per micro-batch, per cp rank (tp ranks share them)
    layers, moe_layers = shape["layers"] / c.pp, shape["moe_layers"] / c.pp
    per_micro = (2 * act_bytes + 4) * shape["dense"] / (c.tp * c.pp) * ring(fsdp)
    efsdp = fsdp * c.tp // (c.ep * c.etp) if c.ep > 1 else fsdp
    per_micro += (2 * act_bytes + 4) * shape["expert"] / c.pp / (c.ep * c.etp if c.ep > 1 else c.tp) * ring(efsdp)
    tp_collectives = 8 + (4 if c.ac == "full" else 0)
    per_micro += layers * tp_collectives * tokens * shape["dim"] * act_bytes * ring(c.tp)
    per_micro += layers * 2 * 2 * tokens * c.cp * shape["dim"] / 2 / c.tp * act_bytes * ring(c.cp)
    ep_calls = 4 + (2 if c.ac == "full" else 0)
    per_micro += moe_layers * ep_calls * tokens / c.tp * shape["top_k"] * shape["dim"] * act_bytes * ring(c.ep)
    per_micro += 4 * (shape["dense"] / (c.tp * c.pp * fsdp)) * 2 * ring(c.dp_replicate)
    if c.pp > 1:
        per_micro += 2 * tokens / c.tp * shape["dim"] * act_bytes
    per_step = per_micro * c.accumulation
    tokens_per_rank = c.local_batch_size * c.accumulation * seq_len * c.dp_replicate * c.dp_shard / world_size
    return per_step / tokens_per_rank
