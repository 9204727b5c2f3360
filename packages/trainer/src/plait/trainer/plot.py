"""plait-plot: the curves of one or more runs' metrics.jsonl, overlaid and labelled by run, in one
PNG or SVG (by the output file's suffix).

    plait-plot RUN [RUN ...] [-o OUT.png|svg] [--label NAME ...] [--series loss,grad_norm,...] [--title T]

One panel per series that at least one run has (plot_series.PANELS: loss with the validation loss
dashed, multi-token prediction loss per depth, grad norm, learning rate, tokens/s, memory, MoE load
imbalance per layer), each run in one colour across the panels. Which runs and which lines:
plot_series.py. matplotlib is an optional extra (plait-trainer[plot]), imported only to draw, so
the trainer never needs it; drawing uses the Agg canvas and never pyplot (no global figure state in
a caller such as a benchmark that draws many figures).
"""

import argparse
import math
import sys
from pathlib import Path

from .plot_series import METRICS, Curve, Panel, PlotError, chosen_panels, curves, find_runs

MISSING_MATPLOTLIB = "plait-plot needs matplotlib: pip install 'plait-trainer[plot]'"
FORMATS = (".png", ".svg")
LEGEND_MAX = 12  # more lines than this (the MoE layers of a deep model): no legend, it would cover the panel
LAYER_STYLES = ["-", "--", ":", "-."]  # one run's layers share its colour; the style tells neighbours apart


def _figure_classes():
    """matplotlib's Figure and Agg canvas, or the one-line refusal when it is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(MISSING_MATPLOTLIB) from None
    return Figure, FigureCanvasAgg


def _plot_curve(ax, curve: Curve, colour: str, nth: int) -> None:
    """`nth`: the curve's place among its run's curves in this panel (a layer's line style)."""
    if curve.kind == "val":
        ax.plot(curve.steps, curve.values, color=colour, linestyle="--", marker="o", markersize=4, label=curve.label)
    elif curve.kind == "layer":
        style = LAYER_STYLES[nth % len(LAYER_STYLES)]
        ax.plot(curve.steps, curve.values, color=colour, linestyle=style, linewidth=1, label=curve.label)
    else:
        ax.plot(curve.steps, curve.values, color=colour, linewidth=1.5, label=curve.label)


def _draw_panel(ax, panel: Panel, lines: list[tuple[int, int, Curve]]) -> None:
    """`lines`: (run index, place among the run's curves here, curve)."""
    for run_index, nth, curve in lines:
        _plot_curve(ax, curve, f"C{run_index % 10}", nth)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps: no 2.25 on a short run's axis
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if len(lines) <= LEGEND_MAX:
        ax.legend(fontsize="small")


def _output_format(out: Path) -> str:
    if out.suffix.lower() not in FORMATS:
        raise PlotError(f"plait-plot: cannot write {out}: the output must end in {' or '.join(FORMATS)}")
    return out.suffix.lower()[1:]


def draw(runs: list[Path], out: Path | None = None, labels: list[str] | None = None,
         series: list[str] | None = None, title: str | None = None):  # fmt: skip
    """The figure of `runs` (dump folders or metrics.jsonl paths, see plot_series), written to `out`
    (PNG or SVG by its suffix; None: not written). `labels`: one per run (default: the folders'
    names); `series`: the panels by name (default: every one with data). Returns the matplotlib
    Figure; raises PlotError (one line) when there is nothing to draw or no matplotlib."""
    fmt = _output_format(Path(out)) if out is not None else None
    found = find_runs([Path(r) for r in runs], labels)
    panels = []
    for panel in chosen_panels(series):
        lines = [(i, nth, c) for i, run in enumerate(found) for nth, c in enumerate(curves(panel.name, run))]
        if lines:
            panels.append((panel, lines))
    if not panels:
        names = ", ".join(p.name for p in chosen_panels(series))
        raise PlotError(f"plait-plot: no training rows with {names} in {', '.join(str(r.path) for r in found)}")
    Figure, FigureCanvasAgg = _figure_classes()
    ncols = 1 if len(panels) <= 2 else 2
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(6.4 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (panel, lines) in zip(axes, panels):
        _draw_panel(ax, panel, lines)
    for ax in axes[len(panels) :]:
        figure.delaxes(ax)
    if title:
        figure.suptitle(title)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, format=fmt, dpi=120)
    return figure


def default_output(first_run: Path) -> Path:
    """`<first run>/metrics.png` (beside the metrics.jsonl when the run was named by that file)."""
    folder = first_run.parent if first_run.name == METRICS or first_run.is_file() else first_run
    return folder / "metrics.png"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="plait-plot", description="Draw the curves of runs' metrics.jsonl, overlaid, in one PNG or SVG."
    )
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                        help="a plait-train dump folder (or its metrics.jsonl); a fault-tolerant run's folder "
                             "draws each replica_<i>/ as a run")  # fmt: skip
    parser.add_argument("-o", "--output", type=Path, help="OUT.png or OUT.svg (default: <first RUN>/metrics.png)")
    parser.add_argument("--label", nargs="+", action="extend", metavar="NAME",
                        help="one name per RUN, in order (default: the folder's name)")  # fmt: skip
    parser.add_argument("--series", help="comma-separated panels, in order, from: "
                        + ",".join(p.name for p in chosen_panels(None)) + " (default: every one with data)")  # fmt: skip
    parser.add_argument("--title", help="a title over the figure")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.output or default_output(args.runs[0])
    series = [s.strip() for s in args.series.split(",") if s.strip()] if args.series else None
    try:
        draw(args.runs, out, labels=args.label, series=series, title=args.title)
    except PlotError as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:  # a metrics file that cannot be read, an output that cannot be written
        print(f"plait-plot: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(out)


if __name__ == "__main__":
    main()
