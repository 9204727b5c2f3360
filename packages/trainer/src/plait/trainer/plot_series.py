"""What plait-plot draws, without matplotlib: runs found from the command line, their metrics.jsonl
rows, and each panel's curves as plain (x, y) lists.

A run is a dump folder, or its metrics.jsonl. A fault-tolerant run's folder holds one dump folder per
replica group (replica_<i>/, config.build_config) and no metrics.jsonl of its own: each replica is
a run of its own, labelled `<name>/replica_<i>`. Training rows are the ones with "loss"; a
validation row has only "step" and "val_loss" (metrics.MetricsLogger.log_scalars).
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

METRICS = "metrics.jsonl"


class PlotError(Exception):
    """A one-line refusal, the whole line (it names plait-plot): plait-plot prints it and exits 2."""


@dataclass
class Run:
    label: str
    path: Path  # its metrics.jsonl
    rows: list[dict] = field(default_factory=list)


@dataclass
class Curve:
    """One line of a panel. `kind`: "train" (solid), "val" (dashed, with markers) or "layer" (one of
    several per run: thin)."""

    label: str
    steps: list[float]
    values: list[float]
    kind: str = "train"


@dataclass(frozen=True)
class Panel:
    name: str  # what --series calls it
    title: str
    ylabel: str


# In drawing order. The names are metrics.jsonl's keys (loss also draws val_loss).
PANELS = [
    Panel("loss", "loss", "loss"),
    Panel("mtp_loss", "multi-token prediction loss", "loss"),
    Panel("grad_norm", "grad norm", "norm"),
    Panel("lr", "learning rate", "lr"),
    Panel("tokens_per_second", "tokens/s", "tokens/s (all ranks)"),
    Panel("memory_gib", "memory (GiB)", "GiB (peak)"),
    Panel("moe_imbalance", "MoE load imbalance per layer", "max / mean tokens per expert"),  # per MoE layer
]
PANEL_BY_NAME = {p.name: p for p in PANELS}


def _replica_number(path: Path) -> int:
    return int(path.parent.name.rsplit("_", 1)[1])


def _metrics_files(arg: Path) -> list[tuple[str, Path]]:
    """(label suffix, metrics.jsonl) of one RUN argument."""
    if arg.is_file():
        return [("", arg)]
    if (arg / METRICS).is_file():
        return [("", arg / METRICS)]
    replicas = [p for p in arg.glob(f"replica_*/{METRICS}") if re.fullmatch(r"replica_\d+", p.parent.name)]
    if arg.is_dir() and replicas:
        return [(f"/{p.parent.name}", p) for p in sorted(replicas, key=_replica_number)]
    raise PlotError(
        f"plait-plot: no {METRICS} in {arg} (nor replica_<i>/{METRICS}): pass a plait-train dump folder or its {METRICS}"
    )


def _default_label(arg: Path) -> str:
    folder = arg.parent if arg.is_file() else arg
    return folder.resolve().name or str(folder)


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows. A line cut short (the run was killed while writing it) is skipped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def find_runs(args: list[Path], labels: list[str] | None = None) -> list[Run]:
    """The runs named by `args` (see the module's doc), labelled by `labels` (one per argument) or by
    their folders' names."""
    if labels is not None and len(labels) != len(args):
        raise PlotError(f"plait-plot: {len(labels)} labels for {len(args)} runs: give one --label per run")
    runs = []
    for i, arg in enumerate(args):
        name = labels[i] if labels is not None else _default_label(Path(arg))
        for suffix, path in _metrics_files(Path(arg)):
            runs.append(Run(name + suffix, path, read_rows(path)))
    return runs


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalar_curve(label: str, rows: list[dict], key: str, kind: str = "train") -> list[Curve]:
    points = [(row["step"], row[key]) for row in rows if _is_number(row.get(key))]
    return [Curve(label, [s for s, _ in points], [v for _, v in points], kind)] if points else []


def _per_layer(row: dict, key: str) -> dict[int, float]:
    """{layer: value} of a per-layer key: metrics.jsonl's list, or TensorBoard's `key/<i>` scalars."""
    if isinstance(row.get(key), list):
        return {i: v for i, v in enumerate(row[key]) if _is_number(v)}
    prefix = key + "/"
    return {int(k[len(prefix) :]): v for k, v in row.items()
            if k.startswith(prefix) and k[len(prefix) :].isdigit() and _is_number(v)}  # fmt: skip


def _layer_curves(label: str, rows: list[dict], key: str, name: str, first: int = 0) -> list[Curve]:
    """One curve per entry of a per-layer key, labelled `<run> <name> <i>` counting from `first`."""
    by_layer: dict[int, Curve] = {}
    for row in rows:
        for layer, value in _per_layer(row, key).items():
            curve = by_layer.setdefault(layer, Curve(f"{label} {name} {first + layer}", [], [], "layer"))
            curve.steps.append(row["step"])
            curve.values.append(value)
    return [by_layer[layer] for layer in sorted(by_layer)]


def curves(panel: str, run: Run) -> list[Curve]:
    """One run's lines in one panel (none: the run has no such data)."""
    train = [row for row in run.rows if "loss" in row]
    if panel == "loss":
        val = [row for row in run.rows if "loss" not in row]
        return _scalar_curve(run.label, train, "loss") + _scalar_curve(f"{run.label} val", val, "val_loss", "val")
    if panel == "mtp_loss":
        return _layer_curves(run.label, train, "mtp_loss", "depth", first=1)  # DeepSeek-V3 counts depths from 1
    if panel == "moe_imbalance":
        return _layer_curves(run.label, train, "moe_imbalance", "layer")
    return _scalar_curve(run.label, train, panel)


def chosen_panels(series: list[str] | None) -> list[Panel]:
    """The panels --series names, in its order (None: all, in PANELS' order)."""
    if series is None:
        return list(PANELS)
    unknown = [name for name in series if name not in PANEL_BY_NAME]
    if unknown:
        raise PlotError(f"plait-plot: unknown series {', '.join(unknown)}; choose from {','.join(PANEL_BY_NAME)}")
    return [PANEL_BY_NAME[name] for name in series]
