"""One RESULTS.md section from what a GPU lease (gpu/lease.sh) left in its output folder.

    python benchmarks/lease_table.py OUT                                    OUT/table.md, printed
    python benchmarks/lease_table.py OUT --results benchmarks/RESULTS.md    ... and prepended there

OUT is the lease's $OUT (the folder the device call brought back, its `files_at`) or its copy
under benchmarks/leases/<date>-<commit>/ (benchmarks/lease_archive.py makes it; its README lists
every file and field): env.txt, stages.tsv, suite.log, signature.txt, nvidia-smi.txt, parity.jsonl,
bench.jsonl, plan.jsonl, gemm.jsonl and varlen.jsonl, any of them missing where a stage did not
run. The section: the machine, torch, commit and stage times; the GPU as nvidia-smi reported it
(idle and under a GEMM load: benchmarks/lease_machine.py); the GPU suite's summary line (and its
failures); the varlen signature; the CUDA parity table (one row per parity.jsonl entry); one table
of every training run (config x attention x framework / mode: tokens/s, step time by the wall
clock and by CUDA events, TFLOP/s, MFU with causal attention whole and halved, that over the best
measured GEMM, peak GiB measured and planned, planned step, host launch and GPU busy ms per step,
plait / torchtitan on the causal rows where torchtitan did the same work, document / causal on
the document rows); the GEMMs; and the one-call vs per-segment attention rows. A dry run's folder
(sample outputs, not measurements) is titled as such and refused by --results unless
--dry-run-ok. No torch needed: it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from lease_machine import gemm_best, gemm_table, smi_line

CONFIG_ORDER = ("llama3-1B", "llama3-8B", "deepseek-16B")
DIMS = {
    "llama3-1B": "Llama 3.2 1B",
    "llama3-8B": "Llama 3 8B dims",
    "deepseek-16B": "DeepSeek-V3 16B dims",
}
MODE_ORDER = ("eager", "compile", "cudagraphs", "float8tw", "float8rw", "float8x", "chunked", "bf16states", "torchtitan")
MODE_NAMES = {"eager": "plait eager", "compile": "plait compile", "cudagraphs": "plait CUDA graphs",
              "float8tw": "plait compile, float8 tensorwise", "float8rw": "plait compile, float8 rowwise",
              "float8x": "plait compile, float8 rowwise + float8 experts", "chunked": "plait compile, chunked loss",
              "bf16states": "plait compile, bf16 optimizer states"}
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


BENCH_HEADER = ["| config | attention | framework / mode | tokens/s | step ms, wall | step ms, CUDA events | TFLOP/s | "
                "MFU | MFU, causal halved | of best GEMM | peak GiB | planned GiB | planned ms | host launch ms/step | "
                "GPU busy ms/step | plait / torchtitan | document / causal |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or not (b.get("tokens_per_second") or 0) > 0:
        return ""
    return f"{a['tokens_per_second'] / b['tokens_per_second']:.2f}x"


def _figures(r: dict, plan: dict, gemm_tflops: float | None) -> str:
    """The row's measured and planned figures, the table's columns 4 to 15."""
    profile = r.get("profile") or {}  # (records before it had `busy`: not per step, not shown)
    events = _num(r.get("step_ms_events"), ".1f")
    if abs((r.get("events_vs_wall") or 1.0) - 1) > 0.02:
        events += f" ({r['events_vs_wall']:.3f}x wall!)"
    mfu = r.get("mfu_attn_whole", r.get("mfu"))
    of_gemm = r["tflops"] / gemm_tflops if gemm_tflops and r.get("tflops") else None
    cells = [_num(r.get("tokens_per_second"), ",.0f"), _num(r.get("step_ms_wall"), ".1f"), events,
             _num(r.get("tflops"), ".0f"), _num(mfu, ".1%"), _num(r.get("mfu_attn_half"), ".1%"), _num(of_gemm, ".0%"),
             _num(r.get("memory_gib"), ".1f"), _num(plan.get("planned_peak_gib"), ".1f"),
             _num(plan.get("planned_step_ms"), ".0f"), _num(profile.get("host_launch_ms"), ".0f"),
             _num(profile.get("gpu_busy_ms"), ".0f")]  # fmt: skip
    return " | ".join(cells)


def bench_table(records: list[dict], plans: list[dict] | None = None, gemm: list[dict] | None = None) -> list[str]:
    """The training runs, in a fixed order (config, attention, mode), one row each (the last
    record of a repeated run wins), with plait-plan's figures (plan.jsonl) and the best GEMM of
    the config (gemm.jsonl) where given."""
    runs = {(r["config"], r["mask"], r["mode"]): r for r in records}
    ok = {key: r for key, r in runs.items() if "error" not in r}
    planned = {(p["config"], p["mask"], p["mode"]): p for p in plans or []}
    best = gemm_best(gemm or [])
    lines = list(BENCH_HEADER)
    order = sorted(runs, key=lambda k: (CONFIG_ORDER.index(k[0]) if k[0] in CONFIG_ORDER else 99,
                                        k[1] != "causal", MODE_ORDER.index(k[2]) if k[2] in MODE_ORDER else 99))  # fmt: skip
    for key in order:
        config, mask, mode = key
        r = runs[key]
        if "error" in r:
            lines.append(f"| {config} | {mask} | {_label(r)} | {r['error']} |{' |' * 13}")
            continue
        tt = ok.get((config, "causal", "torchtitan"))
        equal = tt is not None and tt.get("equal_work", True)  # records before `equal_work`: 0.3.0, never ran
        vs_tt = _ratio(r, tt) if mode != "torchtitan" and mask == "causal" and equal else ""
        vs_causal = _ratio(r, ok.get((config, "causal", mode))) if mask == "document" else ""
        note = f" ({r['note']})" if r.get("note") else ""
        if mode == "torchtitan" and r.get("equal_work") is False:
            note += " (not plait's work: no ratio)"
        if mode.startswith("float8") and _ratio(r, ok.get((config, mask, "compile"))):
            note += f" ({_ratio(r, ok.get((config, mask, 'compile')))} bf16 compile)"
        plan = planned.get(key, {})
        lines.append(f"| {config} | {mask} | {_label(r)}{note} | {_figures(r, plan, best.get(config))} | "
                     f"{vs_tt} | {vs_causal} |")  # fmt: skip
    return lines


def parity_table(rows: list[dict]) -> list[str]:
    """parity.jsonl (the lease's `parity` stage): one row per entry, in its order."""
    lines = ["| layout | model | dtype | ranks | max loss diff | max grad-norm diff (rel) | host syncs / step "
             "(expected) | passed |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        syncs = f"{r.get('host_syncs_per_step', '-')} ({r.get('expected_host_syncs', '-')})"
        entry = " | ".join(str(r.get(key, "?")) for key in ("layout", "model", "dtype", "ranks"))
        lines.append(f"| {entry} | {_num(r.get('max_loss_diff'), '.2e')} | {_num(r.get('max_grad_norm_rel_diff'), '.2e')} "
                     f"| {syncs} | {'yes' if r.get('passed') else 'NO'} |")  # fmt: skip
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


def _records(out: Path, env: dict[str, str]) -> list[dict]:
    """bench.jsonl, plus a "not run" record for each planned run without one (the stage ended first)."""
    records = read_jsonl(out / "bench.jsonl")
    done = {(r["config"], r["mask"], r["mode"]) for r in records}
    tt_version = next((r["torchtitan_version"] for r in records if r.get("torchtitan_version")), "")
    for spec in filter(None, env.get("runs", "").split(",")):
        config, mask, mode = (spec.split(":") + ["?", "?"])[:3]
        if (config, mask, mode) not in done:
            records.append({"config": config, "mask": mask, "mode": mode, "error": "not run: the stage ended first",
                            **({"torchtitan_version": tt_version} if mode == "torchtitan" else {})})  # fmt: skip
    return records


BENCH_TEXT = (
    "{dims}; bf16, selective AC, one GPU (no expert parallel); {steps} steps, medians of those after {warmup} "
    "warmup (compile, autotuning, CUDA graph recording). Step ms: sync to sync by the wall clock (plait: "
    "`step_time_s`, one step per flush; torchtitan: tokens / its tps) and, plait only, by CUDA events "
    "(`device_step_s`; `!` where the two differ by more than 2 %). TFLOP/s and both MFUs: plait's FLOPs per "
    "token of the model (6 x non-embedding params + attention) x tokens/s, for both frameworks (the same "
    "model), over 989 TFLOP/s dense bf16; MFU counts causal attention whole (plait's and torchtitan's "
    "convention), the next column halved; of best GEMM: TFLOP/s over the fastest bf16 GEMM of the model's "
    "shapes measured on this GPU (below). Peak GiB: max_memory_allocated (plait) or torchtitan's log; planned: "
    "plait-plan's traced peak and ideal step (its FLOPs at 989 TFLOP/s) for the same arguments. Host launch and "
    "GPU busy ms per step: the last step profiled, that step alone (profile_summary.step_profile: its "
    "ProfilerStep span less the time blocked in CUDA syncs and copies; the union of the device work its CUDA "
    "calls launched; profiler overhead included). torchtitan (the version that fits the lease's torch) runs "
    "at the same depth, batch, sequence, compiled, with causal attention and plait's selective-AC save list "
    "(its row says; plait / torchtitan only where its run was that work). {not_run} run(s) not started for "
    "the budget."
)


def _bench_parts(out: Path, env: dict[str, str]) -> list[str]:
    records = _records(out, env)
    if not records:
        return []
    dims = {r["config"]: f"{DIMS.get(r['config'], r['config'])}: {r['layers']} layers, seq {r['seq']}, batch {r.get('batch', 1)}"
            for r in records if "layers" in r and "seq" in r}  # fmt: skip
    not_run = sum(1 for r in records if r.get("skipped") or r.get("error", "").startswith("not run"))
    text = BENCH_TEXT.format(dims=f"Training steps: {'; '.join(dims.values()) or 'no run finished'}",
                             steps=env.get("steps", "?"), warmup=env.get("warmup", "?"), not_run=not_run)  # fmt: skip
    gemm = read_jsonl(out / "gemm.jsonl")
    parts = ["", text, "", *bench_table(records, read_jsonl(out / "plan.jsonl"), gemm)]
    if gemm:
        clock = "the host clock" if gemm[0].get("dry_run") else "CUDA events"
        parts += ["", f"bf16 GEMMs at the models' largest shapes (`benchmarks/gemm_peak.py`, {gemm[0]['device']}; "
                  f"medians of {gemm[0]['reps']} calls timed by {clock}):", "", *gemm_table(gemm)]  # fmt: skip
    return parts


def _parity_parts(out: Path) -> list[str]:
    rows = read_jsonl(out / "parity.jsonl")
    if not rows:
        return []
    passed = sum(1 for r in rows if r.get("passed"))
    device = rows[0].get("device", "?")
    return ["", f"Parity on CUDA (parity.jsonl, the `parity` stage): {passed} of {len(rows)} entries passed, each "
            f"against one rank on the same GPU ({device}).", "", *parity_table(rows)]  # fmt: skip


def _varlen_parts(out: Path) -> list[str]:
    varlen = read_jsonl(out / "varlen.jsonl")
    if not varlen:
        return []
    v = varlen[0]
    return ["", f"Document attention, one call (`plait::document_attention`) vs per segment (one SDPA call per "
            f"document): {v['heads']} heads, {v['kv_heads']} kv heads, head dim {v['head_dim']}, seq {v['seq']}, "
            f"{v['dtype']}, {v['device']}; equal documents; medians (device time by CUDA events on a GPU; host: "
            "until the last op is queued). `benchmarks/bench_varlen.py`.", "", *varlen_table(varlen)]  # fmt: skip


def section(out: Path, commit: str | None = None) -> str:
    env = read_env(out)
    dry = env.get("dry_run") == "1"
    date = env.get("date", "?").split(" ")[0]
    title = (f"## GPU lease DRY RUN, {date} (`gpu/lease.sh --dry-run`: CPU, sample outputs, not measurements)"
             if dry else f"## GPU lease, {date} (`gpu/lease.sh`)")  # fmt: skip
    stages = read_stages(out)
    stage_text = ", ".join(
        f"{name} {seconds} s" + ("" if rc in ("0", "") else f" (exit {rc}{', its limit' if rc in ('124', '137') else ''})")
        for name, rc, seconds, _ in stages
    )  # fmt: skip
    smi = smi_line(out)
    parts = [
        title,
        "",
        f"{env.get('gpu', '?')}; python {env.get('python', '?')}, torch {env.get('torch', '?')}, triton "
        f"{env.get('triton', '?')}; commit {commit or env.get('commit', '?')}. Stages: {stage_text or 'none'}; "
        f"{sum(s[2] for s in stages)} s of the {env.get('total_s', '?')} s budget. Raw outputs: "
        "benchmarks/leases/ (README there).",
        "",
        *([smi] if smi else []),
        f"- GPU suite (`python gpu/run.py`): {suite_lines(out)[0]}",
        *[f"  - {line}" for line in suite_lines(out)[1]],
        f"- Varlen signature (`flash_signature()`): {signature(out)}",
    ]
    parts += _parity_parts(out) + _bench_parts(out, env) + _varlen_parts(out)
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
