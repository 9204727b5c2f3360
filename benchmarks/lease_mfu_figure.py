"""The lease's MFU per run as a figure (issue 55): one horizontal bar per training run of bench.jsonl
(config, attention, framework / mode), drawn next to the lease's table by lease_archive.py.
matplotlib is optional (plait-trainer[plot]): without it, or without a finished run, no figure."""

from pathlib import Path

from lease_table import _label


def draw_mfu(records: list[dict], path: Path) -> bool:
    """Write the figure to `path` (PNG or SVG by suffix); whether one was written."""
    runs = {(r["config"], r["mask"], r["mode"]): r for r in records}  # the last record of a repeated run wins
    done = [r for r in runs.values() if "error" not in r and r.get("mfu_attn_whole", r.get("mfu")) is not None]
    if not done:
        return False
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    labels = [f"{r['config']} {r['mask']}, {_label(r)}" for r in done]
    mfus = [100 * r.get("mfu_attn_whole", r.get("mfu")) for r in done]
    figure = Figure(figsize=(8, 0.4 * len(done) + 1.2), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    bars = ax.barh(range(len(done)), mfus, color=[f"C{i % 10}" for i in range(len(done))])
    ax.set_yticks(range(len(done)), labels)
    ax.invert_yaxis()  # the table's order, top down
    ax.bar_label(bars, fmt="%.1f %%", padding=3)
    ax.set_xlabel("MFU (%), causal attention counted whole")
    ax.set_title("MFU per run (one GPU, bf16)")
    ax.set_xlim(0, max(mfus) * 1.2)
    figure.savefig(path)
    return True
