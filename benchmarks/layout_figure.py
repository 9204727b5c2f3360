"""The benchmark suite's tokens/s per layout as a figure (issue 55): one horizontal bar per plait
run of `benchmarks/suite.py` (config or scaling layout, eager or compiled; the median of its kept
steps), drawn next to the suite's tables in RESULTS.md. matplotlib is optional
(plait-trainer[plot]): without it, or without a finished run, no figure."""

from pathlib import Path


def draw_tokens_per_second(medians: dict[str, float | None], path: Path, title: str) -> bool:
    """`medians`: run name ("plait:<layout>:<mode>") -> global tokens/s (None: failed). Writes the
    figure to `path` (PNG or SVG by suffix); whether one was written."""
    done = {name.removeprefix("plait:").replace(":", ", "): tps for name, tps in medians.items()
            if name.startswith("plait:") and tps}  # fmt: skip
    if not done:
        return False
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    figure = Figure(figsize=(8, 0.35 * len(done) + 1.2), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    bars = ax.barh(range(len(done)), list(done.values()), color=[f"C{i % 10}" for i in range(len(done))])
    ax.set_yticks(range(len(done)), list(done))
    ax.invert_yaxis()  # the suite's order, top down
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("global tokens/s (median of kept steps)")
    ax.set_title(title)
    ax.set_xlim(0, max(done.values()) * 1.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return True
