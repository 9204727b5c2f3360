"""What torch's own action order says about one pp rank's step (torch 2.13's
`schedule.pipeline_order`, compute actions per rank, and for its runtime schedules
`pipeline_order_with_comms`, the same lowered with UNSHARD / SEND / RECV / REDUCE_GRAD):
the point-to-point transfers, FSDP's gathers, and the memory of the micro-batches in flight
given each stage's traced micro-batch (plan/pipeline.py traces them).

Activations in flight: a forward adds its micro-batch's saved activations; a full backward (B)
or a weight backward (W) releases them; an input backward (I) keeps them for its W. Counted on
torch's orders at pp 2 and 4, rank 0 holds at most: GPipe m, 1F1B p, Interleaved1F1B
(v-1) p + 2 (p-1) + 1, InterleavedZeroBubble and ZBVZeroBubble v p, DualPipeV v p + 1
(memory_estimate.pp_in_flight states them for the analytic estimate).
"""

import dataclasses

# Bubble fraction of the ideal time (stated with the plan): p stages (pp), v stages per rank, m micro-batches.
BUBBLE = {
    "GPipe": ("(p-1)/(m+p-1)", lambda p, v, m: (p - 1) / (m + p - 1)),
    "1F1B": ("(p-1)/(m+p-1)", lambda p, v, m: (p - 1) / (m + p - 1)),
    "LoopedBFS": ("(p-1)/(m+p-1)", lambda p, v, m: (p - 1) / (m + p - 1)),
    "Interleaved1F1B": ("(p-1)/(v*m+p-1)", lambda p, v, m: (p - 1) / (v * m + p - 1)),
    # Zero-bubble schedules fill the bubble with weight gradients; the interleaved figure is their bound.
    "InterleavedZeroBubble": ("<= (p-1)/(v*m+p-1)", lambda p, v, m: (p - 1) / (v * m + p - 1)),
    "ZBVZeroBubble": ("<= (p-1)/(v*m+p-1)", lambda p, v, m: (p - 1) / (v * m + p - 1)),
    "DualPipeV": ("<= (p-1)/(v*m+p-1)", lambda p, v, m: (p - 1) / (v * m + p - 1)),
}


def p2p_actions(schedule, stages, rank: int = 0) -> dict:
    """SEND_F / RECV_F / SEND_B / RECV_B of `rank` per step: torch's lowered order for runtime
    schedules; for single-stage ones (GPipe, 1F1B) every F sends unless last and receives unless
    first, every B the mirror."""
    counts = {"SEND_F": 0, "RECV_F": 0, "SEND_B": 0, "RECV_B": 0}
    lowered = getattr(schedule, "pipeline_order_with_comms", None)
    if lowered:
        for action in lowered[rank]:
            name = action.computation_type.value if hasattr(action.computation_type, "value") else str(
                action.computation_type)
            if name in counts:
                counts[name] += 1
        return counts
    stage = stages[0]
    for action in schedule.pipeline_order[rank]:
        kind = _kind(action)
        if kind == "F":
            counts["SEND_F"] += not stage.is_last
            counts["RECV_F"] += not stage.is_first
        elif kind in ("B", "I"):
            counts["SEND_B"] += not stage.is_first
            counts["RECV_B"] += not stage.is_last
    return counts


def unshard_counts(schedule, rank: int = 0) -> dict[int, int]:
    """UNSHARD actions per stage in torch's lowered order (1 per stage unless a rank holds more
    stages than torch keeps gathered); single-stage schedules gather once, in the first forward."""
    lowered = getattr(schedule, "pipeline_order_with_comms", None)
    counts: dict[int, int] = {}
    if not lowered:
        return counts
    for action in lowered[rank]:
        if _kind(action) == "UNSHARD":
            counts[action.stage_index] = counts.get(action.stage_index, 0) + 1
    return counts


def _kind(action) -> str | None:
    if action is None:
        return None
    ct = action.computation_type
    return {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
        getattr(ct, "name", ""), getattr(ct, "name", str(ct)))


def _compute_actions(order):
    """Rank's compute actions in order, overlapped F+B pairs unfolded."""
    for action in order:
        if action is None:
            continue
        if action.sub_actions:
            yield from action.sub_actions
        elif _kind(action) in ("F", "B", "I", "W"):
            yield action


@dataclasses.dataclass
class StageMemory:
    """One stage's micro-batch, in bytes relative to the memory before its forward."""

    saved: int = 0  # held from the end of its forward to its backward (activations, the stage output)
    forward_peak: int = 0
    backward_peak: int = 0  # includes `saved` and the gradients it creates
    grads: int = 0  # still held after its first backward (the accumulated, unreduced gradients)
    later_forward_peak: int = 0  # the same once the stage holds gradients (these not included)
    later_backward_peak: int = 0
    forward_where: str = ""
    backward_where: str = ""


def walk_memory(order, stage_memory: dict[int, StageMemory]) -> dict:
    """Walk `order` (torch's compute actions of one rank): the highest memory above the stages'
    common base, where it is reached and the micro-batches in flight (forwarded, weights not yet
    back-propagated) at most."""
    held: dict[tuple[int, int], int] = {}
    grads: dict[int, int] = {}
    best = {"bytes": 0, "stage": None, "phase": "", "where": "", "grads": 0, "in_flight_at_peak": 0}
    most = 0
    for action in _compute_actions(order):
        s, mb, kind = action.stage_index, action.microbatch_index, _kind(action)
        mem = stage_memory[s]
        others = sum(v for k, v in held.items() if k != (s, mb)) + sum(grads.values())
        if kind == "F":
            here = others + (mem.later_forward_peak if s in grads else mem.forward_peak)
            phase, where = "forward", mem.forward_where
            held[(s, mb)] = mem.saved
            most = max(most, len(held))
        elif kind in ("B", "I"):
            here = others + (mem.later_backward_peak if s in grads else mem.backward_peak)
            phase, where = "backward", mem.backward_where
            if kind == "B":
                held.pop((s, mb), None)
                grads[s] = mem.grads
        else:  # W: the saved inputs of the weight gradients go
            held.pop((s, mb), None)
            grads[s] = mem.grads
            here, phase, where = sum(held.values()) + sum(grads.values()), "backward", mem.backward_where
        if here > best["bytes"]:
            best = {"bytes": here, "stage": s, "phase": phase, "where": where, "grads": sum(grads.values()),
                    "in_flight_at_peak": len(held) if kind == "F" else len(held) + (kind == "B")}
    best["max_in_flight"] = most
    return best
