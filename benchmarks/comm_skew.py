"""How much of a step's exposed communication is waiting for the peer, from every rank's trace.

`profile_summary.summarize` counts the time the training thread waits in collectives ("exposed").
A collective cannot finish before the last rank has entered it, so a wait has two parts:

  peer late   this rank entered first and waits for the others to arrive: set by the work the
              ranks do before the collective (unequal expert rows, a rank slowed by the other's
              threads), removable only by evening that work out, not by any overlap
  transfer    every rank is in: the bytes moving (gloo's worker copying and sending), the part
              overlap can hide

The ranks of one machine trace on one clock, so the k-th collective of a kind starts on rank r's
gloo worker at `start_r`; all ranks are in at `max_r start_r`. Each collective kind runs in one
order on every rank (its process group's order), which pairs the k-th events across ranks.
Run on the traces one profiled step wrote for all ranks (`<dump>/profile/step{N}_rank*.json`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from profile_summary import _category, _in_step, _spans_and_steps, _with_ancestors

_WORKER_PREFIX = ("gloo:", "nccl:")


def _worker_collectives(spans: list[dict], begin: float, end: float) -> dict[str, list[tuple[float, float]]]:
    """{kind: [(start, end), ...] in start order} of the collectives the comm workers ran."""
    kinds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in spans:
        if e["name"].startswith(_WORKER_PREFIX) and begin <= e["ts"] <= end:
            kinds[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    for intervals in kinds.values():
        intervals.sort()
    return kinds


def _main_thread_waits(spans: list[dict], step: dict) -> list[tuple[float, float]]:
    """Intervals in which the training thread was in communication, as `summarize` counts it: the
    self time (the span minus its children) of every span it puts in that category."""
    nested = _with_ancestors([e for e in _in_step(spans, step) if e["tid"] == step["tid"]])
    children: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e, ancestors in nested:
        if ancestors:
            children[id(ancestors[-1])].append((e["ts"], e["ts"] + e["dur"]))
    waits = []
    for e, ancestors in nested:
        if _category(e["name"], [a["name"] for a in ancestors]) != "communication":
            continue
        cursor = e["ts"]
        for s, t in _union(children[id(e)]):
            if s > cursor:
                waits.append((cursor, s))
            cursor = max(cursor, t)
        if e["ts"] + e["dur"] > cursor:
            waits.append((cursor, e["ts"] + e["dur"]))
    return waits


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two interval lists (each may overlap itself)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in _union(a) for s2, e2 in _union(b))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def peer_wait(trace_paths: list[Path]) -> list[dict]:
    """Per rank: exposed ms (as summarize counts it), and of it the ms spent while this rank was in
    a collective that another rank had not yet entered (peer late) and the rest; per collective
    kind: count, in-flight ms, of it peer late, and the exposed ms that were peer late in it."""
    ranks = []
    for path in trace_paths:
        spans, steps = _spans_and_steps(path)
        step = max(steps, key=lambda e: e["dur"])
        begin, end = step["ts"], step["ts"] + step["dur"]
        ranks.append((_worker_collectives(spans, begin, end), _main_thread_waits(spans, step)))
    kinds = set.intersection(*(set(k) for k, _ in ranks))
    late: list[dict[str, list[tuple[float, float]]]] = [defaultdict(list) for _ in ranks]
    per_kind: list[dict] = [{} for _ in ranks]
    for kind in sorted(kinds):
        n = min(len(k[kind]) for k, _ in ranks)
        for i in range(n):
            starts = [k[kind][i][0] for k, _ in ranks]
            all_in = max(starts)
            for r, (k, _) in enumerate(ranks):
                s, e = k[kind][i]
                late[r][kind].append((s, min(all_in, e)))
                totals = per_kind[r].setdefault(kind, {"count": 0, "in_flight_ms": 0.0, "peer_late_ms": 0.0})
                totals["count"] += 1
                totals["in_flight_ms"] += (e - s) / 1e3
                totals["peer_late_ms"] += (min(all_in, e) - s) / 1e3
    out = []
    for r, (_, waits) in enumerate(ranks):
        exposed = sum(e - s for s, e in _union(waits))
        exposed_late = _overlap(waits, [i for intervals in late[r].values() for i in intervals])
        for kind, intervals in late[r].items():
            per_kind[r][kind]["exposed_peer_late_ms"] = _overlap(waits, intervals) / 1e3
        out.append({
            "exposed_ms": exposed / 1e3,
            "exposed_peer_late_ms": exposed_late / 1e3,
            "exposed_other_ms": (exposed - exposed_late) / 1e3,
            "per_kind": per_kind[r],
        })  # fmt: skip
    return out


if __name__ == "__main__":
    import sys

    paths = [Path(p) for p in sys.argv[1:]]
    for path, row in zip(paths, peer_wait(paths), strict=True):
        kinds = {k: {f: round(v, 1) for f, v in t.items()} for k, t in row.pop("per_kind").items()}
        print(path.name, {k: round(v, 1) for k, v in row.items()}, kinds)
