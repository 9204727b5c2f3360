"""One RESULTS.md section from what a GPU lease (gpu/lease.sh) left in its output folder.

    python benchmarks/lease_table.py OUT                                    OUT/table.md, printed
    python benchmarks/lease_table.py OUT --results benchmarks/RESULTS.md    ... and prepended there

OUT is the lease's $OUT, i.e. the folder the device call brought back (its `files_at`): env.txt,
stages.tsv, suite.log, signature.txt, varlen.jsonl and bench.jsonl, any of them missing where a
stage did not run. The section: the machine, torch, commit and stage times; the GPU suite's
summary line (and its failures); the varlen signature; one table of every training run (config x
attention x framework / mode: tokens/s, MFU, peak GiB, host and GPU busy ms of the profiled last
step, plait / torchtitan on the causal rows, document / causal on the document rows); and the
one-call vs per-segment attention rows. A dry run's folder (sample outputs, not measurements) is
titled as such and refused by --results unless --dry-run-ok. No torch needed: it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

CONFIG_ORDER = ("llama3-1B", "llama3-8B", "deepseek-16B")
DIMS = {
    "llama3-1B": "Llama 3.2 1B",
    "llama3-8B": "Llama 3 8B dims",
    "deepseek-16B": "DeepSeek-V3 16B dims",
}
MODE_ORDER = ("eager", "compile", "cudagraphs", "float8tw", "float8rw", "float8x", "torchtitan")
MODE_NAMES = {"eager": "plait eager", "compile": "plait compile", "cudagraphs": "plait CUDA graphs",
              "float8tw": "plait compile, float8 tensorwise", "float8rw": "plait compile, float8 rowwise",
              "float8x": "plait compile, float8 rowwise + float8 experts"}
TORCHTITAN_VERSION = "0.3.0"  # records before benchmarks/gpu.py wrote `torchtitan_version` ran this one


def read_env(out: Path) -> dict[str, str]:
    env = {}
    path = out / "env.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        key, sep, value = line.partition(": ")
        if sep:
            env[key.strip()] = value.strip()
    return env


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_stages(out: Path) -> list[tuple[str, str, int, str]]:
    path = out / "stages.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds, limit = (line.split("\t") + ["", "", "0", ""])[:4]
        rows.append((name, rc, int(seconds or 0), limit))
    return rows


def suite_lines(out: Path) -> tuple[str, list[str]]:
    """(gpu/run.py's summary line or what stands for it, the failed tests' lines)."""
    path = out / "suite.log"
    if not path.exists():
        return "not run", []
    lines = path.read_text(errors="replace").splitlines()
    summary = next((ln for ln in reversed(lines) if ln.startswith("plait GPU suite:")), "")
    collected = next((ln for ln in reversed(lines) if re.search(r"\d+ tests? collected", ln)), "")
    if collected:  # a dry run collects the suite, runs none
        summary = f"{summary} ({collected.strip()})" if summary else collected.strip()
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return summary or "no summary line (stopped at its limit?): see suite.log", failed


def signature(out: Path) -> str:
    path = out / "signature.txt"
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.exists() else []
    return lines[-1].strip() if lines else "not found"


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def _label(r: dict) -> str:
    if r["mode"] == "torchtitan":
        version = r.get("torchtitan_version", TORCHTITAN_VERSION)  # "": not known (a run never started)
        name = f"torchtitan {version}" if version else "torchtitan"
        return f"{name} ({r['tt_mode']})" if r.get("tt_mode") else name
    return MODE_NAMES.get(r["mode"], f"plait {r['mode']}")


def bench_table(records: list[dict]) -> list[str]:
    """The training runs, in a fixed order (config, attention, mode), one row each (the last
    record of a repeated run wins)."""
    runs = {(r["config"], r["mask"], r["mode"]): r for r in records}
    ok = {key: r for key, r in runs.items() if "error" not in r}
    lines = ["| config | attention | framework / mode | tokens/s | MFU | peak GiB | host ms/step | "
             "GPU busy ms/step | plait / torchtitan | document / causal |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    order = sorted(runs, key=lambda k: (CONFIG_ORDER.index(k[0]) if k[0] in CONFIG_ORDER else 99,
                                        k[1] != "causal", MODE_ORDER.index(k[2]) if k[2] in MODE_ORDER else 99))  # fmt: skip
    for key in order:
        config, mask, mode = key
        r = runs[key]
        name = config
        if "error" in r:
            lines.append(f"| {name} | {mask} | {_label(r)} | {r['error']} | | | | | | |")
            continue
        busy = r.get("busy") or {}
        tt = ok.get((config, "causal", "torchtitan"))
        vs_tt = ""
        if mode != "torchtitan" and mask == "causal" and tt and tt["tokens_per_second"] > 0:
            vs_tt = f"{r['tokens_per_second'] / tt['tokens_per_second']:.2f}x"
        causal = ok.get((config, "causal", mode))
        vs_causal = ""
        if mask == "document" and causal and causal["tokens_per_second"] > 0:
            vs_causal = f"{r['tokens_per_second'] / causal['tokens_per_second']:.2f}x"
        note = f" ({r['note']})" if r.get("note") else ""
        bf16 = ok.get((config, mask, "compile"))
        if mode.startswith("float8") and bf16 and bf16["tokens_per_second"] > 0:
            note += f" ({r['tokens_per_second'] / bf16['tokens_per_second']:.2f}x bf16 compile)"
        lines.append(
            f"| {name} | {mask} | {_label(r)}{note} | {_num(r.get('tokens_per_second'), ',.0f')} | "
            f"{_num(r.get('mfu'), '.1%')} | {_num(r.get('memory_gib'), '.1f')} | "
            f"{_num(busy.get('host_step_ms'), '.0f')} | {_num(busy.get('device_busy_ms'), '.0f')} | {vs_tt} | {vs_causal} |"
        )
    return lines


def varlen_table(rows: list[dict]) -> list[str]:
    """bench_varlen.py's records: one row per (documents per row, method)."""
    lines = ["| documents / row | method | forward ms | fwd + bwd ms | fwd + bwd host ms | TFLOP/s (fwd + bwd) | "
             "per segment / one call | max abs diff |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    one = {r["documents"]: r for r in rows if r["method"] == "one call"}
    for r in rows:
        ratio = ""
        if r["method"] == "per segment" and r["documents"] in one:
            ratio = f"{r['forward_backward_ms'] / one[r['documents']]['forward_backward_ms']:.2f}x"
        lines.append(f"| {r['documents']} | {r['method']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | "
                     f"{r['forward_backward_host_ms']:.2f} | {r['tflops']:.3g} | {ratio} | {r['max_abs_diff']:.1e} |")
    return lines


def section(out: Path, commit: str | None = None) -> str:
    env = read_env(out)
    dry = env.get("dry_run") == "1"
    date = env.get("date", "?").split(" ")[0]
    title = (f"## GPU lease DRY RUN, {date} (`gpu/lease.sh --dry-run`: CPU, sample outputs, not measurements)"
             if dry else f"## GPU lease, {date} (`gpu/lease.sh`)")  # fmt: skip
    records = read_jsonl(out / "bench.jsonl")
    done = {(r["config"], r["mask"], r["mode"]) for r in records}
    tt_version = next((r["torchtitan_version"] for r in records if r.get("torchtitan_version")), "")
    for spec in filter(None, env.get("runs", "").split(",")):  # planned, no record: the stage ended first
        config, mask, mode = (spec.split(":") + ["?", "?"])[:3]
        if (config, mask, mode) not in done:
            records.append({"config": config, "mask": mask, "mode": mode, "error": "not run: the stage ended first",
                            **({"torchtitan_version": tt_version} if mode == "torchtitan" else {})})  # fmt: skip
    dims = {r["config"]: f"{DIMS.get(r['config'], r['config'])}: {r['layers']} layers, seq {r['seq']}, batch {r.get('batch', 1)}"
            for r in records if "layers" in r and "seq" in r}  # fmt: skip
    varlen = read_jsonl(out / "varlen.jsonl")
    stages = read_stages(out)
    steps, warmup = env.get("steps", "?"), env.get("warmup", "?")
    spent = sum(s[2] for s in stages)
    stage_text = ", ".join(
        f"{name} {seconds} s" + ("" if rc in ("0", "") else f" (exit {rc}{', its limit' if rc in ('124', '137') else ''})")
        for name, rc, seconds, _ in stages
    )  # fmt: skip
    not_run = sum(1 for r in records if r.get("skipped") or r.get("error", "").startswith("not run"))
    parts = [
        title,
        "",
        f"{env.get('gpu', '?')}; python {env.get('python', '?')}, torch {env.get('torch', '?')}, triton "
        f"{env.get('triton', '?')}; commit {commit or env.get('commit', '?')}. Stages: {stage_text or 'none'}; "
        f"{spent} s of the {env.get('total_s', '?')} s budget.",
        "",
        f"- GPU suite (`python gpu/run.py`): {suite_lines(out)[0]}",
        *[f"  - {line}" for line in suite_lines(out)[1]],
        f"- Varlen signature (`flash_signature()`): {signature(out)}",
    ]
    if records:
        parts += [
            "",
            f"Training steps: {'; '.join(dims.values()) or 'no run finished'}; bf16, selective AC, one GPU "
            f"(no expert parallel); {steps} steps, medians "
            f"of those after {warmup} warmup (compile, autotuning, CUDA graph recording); peak memory the largest "
            "logged; host ms and GPU busy ms: the last step, profiled (host: its ProfilerStep span; GPU busy: "
            "the union of its kernels, copies and memsets; profiler overhead included). MFU is each "
            "framework's own formula; tokens/s compare. torchtitan (the version that fits the lease's torch, "
            "named in its rows) runs its flavor's attention defaults (in its rows where it said) at the same "
            f"depth. {not_run} run(s) not started for the budget.",
            "",
            *bench_table(records),
        ]
    if varlen:
        v = varlen[0]
        parts += [
            "",
            f"Document attention, one call (`plait::document_attention`) vs per segment (one SDPA call per "
            f"document): {v['heads']} heads, {v['kv_heads']} kv heads, head dim {v['head_dim']}, seq {v['seq']}, "
            f"{v['dtype']}, {v['device']}; equal documents; medians (device time by CUDA events on a GPU; host: "
            "until the last op is queued). `benchmarks/bench_varlen.py`.",
            "",
            *varlen_table(varlen),
        ]
    return "\n".join(parts) + "\n"


def prepend(results: Path, text: str) -> None:
    """Put the section right below RESULTS.md's title line, newest first (as benchmarks/gpu.py does)."""
    title, _, rest = results.read_text().partition("\n")
    results.write_text(f"{title}\n\n{text}{rest}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the lease's output folder ($OUT, or the files that came back)")
    parser.add_argument("--results", type=Path, help="prepend the section to this RESULTS.md")
    parser.add_argument("--commit", help="the commit the lease ran (where its copy had no .git)")
    parser.add_argument("--dry-run-ok", action="store_true", help="let --results take a dry run's section")
    args = parser.parse_args(argv)
    if not (args.out / "env.txt").exists():
        parser.error(f"{args.out}: no env.txt (not a gpu/lease.sh output folder)")
    text = section(args.out, args.commit)
    print(text)
    try:
        (args.out / "table.md").write_text(text)
    except OSError:  # a read-only folder (the device call's files): the table is printed
        pass
    if args.results:
        if read_env(args.out).get("dry_run") == "1" and not args.dry_run_ok:
            print(f"lease_table: {args.out} is a dry run (sample outputs): not written to {args.results}",
                  file=sys.stderr)
            return 2
        prepend(args.results, text)
        print(f"lease_table: section prepended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
