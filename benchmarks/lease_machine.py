"""The leased machine in benchmarks/lease_table.py's section: what `nvidia-smi -q` said idle and under
a GEMM load (nvidia-smi.txt, written by benchmarks/gemm_peak.py) and what its bf16 GEMMs reached
(gemm.jsonl). No torch: it runs anywhere.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

# Power limits of the H100 / H200 boards (W): SXM 700, NVL 600 (H100 NVL 350-400), PCIe 350. The
# report names the product; the board's limit tells SXM from the others where the name does not.
_SXM_POWER_W = 700.0


def smi_fields(text: str) -> dict[str, str]:
    """`nvidia-smi -q` as {"Section/Sub/Key": value}: sections are the lines without a value,
    nested by indentation; the first value of a key wins (one GPU)."""
    fields: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("#", "=", "(")):
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if sep and value.strip():
            fields.setdefault("/".join([s for _, s in stack] + [key.strip()]), value.strip())
        else:
            stack.append((indent, key.strip()))
    return fields


def smi_sections(text: str) -> tuple[str, str]:
    """(idle report, under-load report) of gemm_peak.py's nvidia-smi.txt."""
    parts = re.split(r"^# nvidia-smi .*$", text, flags=re.M)
    return (parts[1] if len(parts) > 1 else text), (parts[2] if len(parts) > 2 else "")


def _find(fields: dict[str, str], suffix: str) -> str | None:
    return next((v for k, v in fields.items() if k == suffix or k.endswith("/" + suffix)), None)


def _number(value: str | None) -> float:
    match = re.match(r"\s*([\d.]+)", value or "")
    return float(match.group(1)) if match else math.nan


def smi_summary(text: str) -> dict:
    """The figures a reader of the table needs: product, form factor (printed, else read from the
    power limit), power limit, max SM clock; under load: SM clock, power draw, temperature,
    performance state and the clock-event (throttle) reasons active."""
    idle_text, load_text = smi_sections(text)
    idle, load = smi_fields(idle_text), smi_fields(load_text)
    limit = _number(_find(idle, "Current Power Limit") or _find(load, "Current Power Limit"))
    form = _find(idle, "Form Factor")
    if form is None and not math.isnan(limit):
        form = f"SXM by its {limit:.0f} W limit" if limit >= _SXM_POWER_W else f"not SXM by its {limit:.0f} W limit"
    reasons = [k.rsplit("/", 1)[1] for k, v in load.items() if re.search(r"Clocks (Event|Throttle) Reasons/", k)
               and v == "Active"]  # fmt: skip
    return {
        "product": _find(idle, "Product Name") or "?",
        "form_factor": form or "?",
        "power_limit_w": limit,
        "max_sm_clock_mhz": _number(_find(idle, "Max Clocks/SM") or _find(load, "Max Clocks/SM")),
        "load_sm_clock_mhz": _number(load.get("Clocks/SM") or _find(load, "Clocks/SM")),
        "load_power_w": _number(_find(load, "Average Power Draw") or _find(load, "Power Draw")),
        "load_temp_c": _number(_find(load, "GPU Current Temp")),
        "load_pstate": _find(load, "Performance State") or "?",
        "load_reasons": reasons,
    }


def smi_line(out: Path) -> str | None:
    """One line for the section, or None without nvidia-smi.txt."""
    path = out / "nvidia-smi.txt"
    if not path.exists():
        return None
    s = smi_summary(path.read_text(errors="replace"))
    if math.isnan(s["load_sm_clock_mhz"]):
        load = "no report under load"
    else:
        reasons = ", ".join(s["load_reasons"]) or "none"
        load = (f"under the GEMM load SM {s['load_sm_clock_mhz']:.0f} of {s['max_sm_clock_mhz']:.0f} MHz, "
                f"{s['load_power_w']:.0f} W, {s['load_temp_c']:.0f} C, {s['load_pstate']}, clock-event "
                f"reasons active: {reasons}")  # fmt: skip
    return (f"- GPU (`nvidia-smi -q`, nvidia-smi.txt): {s['product']}, form factor {s['form_factor']}, power "
            f"limit {s['power_limit_w']:.0f} W, max SM clock {s['max_sm_clock_mhz']:.0f} MHz; {load}")  # fmt: skip


def gemm_best(records: list[dict]) -> dict[str, float]:
    """config -> the highest median TFLOP/s among its GEMMs (what its step's TFLOP/s is read
    against); none from a dry run (a CPU at reduced dims)."""
    best: dict[str, float] = {}
    for r in records:
        if not r.get("dry_run"):
            best[r["config"]] = max(best.get(r["config"], 0.0), r["tflops"])
    return best


def gemm_table(records: list[dict]) -> list[str]:
    lines = ["| config | GEMM (bf16, x @ W.T) | M x K x N | ms | TFLOP/s (median) | best | of 989 |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        lines.append(f"| {r['config']} | {r['gemm']} | {r['m']} x {r['k']} x {r['n']} | {r['ms']:.3g} | "
                     f"{r['tflops']:.4g} | {r['best_tflops']:.4g} | {r['of_peak']:.1%} |")  # fmt: skip
    return lines
