"""plait-plot (issue 55 item 2): two real short runs overlaid, checked through matplotlib's own
objects (each panel's title, each line's label and data equal to metrics.jsonl's values), not
pixels; PNG and SVG written; a fault-tolerant run's replicas as runs of their own; one-line
refusals (exit 2) for a missing metrics.jsonl and a missing matplotlib."""

import builtins
import json

import pytest

from plait.testing.trainer import read_metrics, run_cli
from plait.trainer.plot import MISSING_MATPLOTLIB, draw, main

# fmt: off
TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "4", "--metrics.log_freq", "2", "--metrics.tensorboard", "false",
        "--metrics.progress_bar", "false", "--metrics.cpu_peak_tflops", "0.1",
        "--data.val_dataset", "builtin", "--data.val_interval", "2", "--data.val_steps", "1"]
# fmt: on
SCALAR_PANELS = {
    "grad norm": "grad_norm",
    "learning rate": "lr",
    "tokens/s": "tokens_per_second",
    "memory (GiB)": "memory_gib",
}  # fmt: skip


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 4-step runs of the Llama 3 debug model (1 layer) with validation every 2 steps, at two
    learning rates: different curves."""
    root = tmp_path_factory.mktemp("plot")
    run_cli(root / "fast", *TINY, "--optimizer.lr", "3e-3")
    run_cli(root / "slow", *TINY, "--optimizer.lr", "1e-4")
    return root / "fast", root / "slow"


def _lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def _series(rows, key):
    return [r["step"] for r in rows if key in r], [r[key] for r in rows if key in r]


def test_two_runs_overlaid_with_their_metrics(two_runs, tmp_path):
    fast, slow = two_runs
    figure = draw([fast, slow], tmp_path / "runs.png", labels=["lr 3e-3", "lr 1e-4"], title="two runs")
    axes = {ax.get_title(): ax for ax in figure.axes}
    # Only the panels these runs have data for (no MTP, no MoE), in order.
    assert list(axes) == ["loss", "grad norm", "learning rate", "tokens/s", "memory (GiB)"]
    assert figure.get_suptitle() == "two runs"
    for label, dump in (("lr 3e-3", fast), ("lr 1e-4", slow)):
        rows = read_metrics(dump)
        train = [r for r in rows if "loss" in r]
        val = [r for r in rows if "loss" not in r]
        assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in val] == [2, 4]
        loss_lines = _lines(axes["loss"])
        assert loss_lines[label] == _series(train, "loss")
        assert loss_lines[f"{label} val"] == _series(val, "val_loss")
        for title, key in SCALAR_PANELS.items():
            assert _lines(axes[title])[label] == _series(train, key), title
    assert len(axes["loss"].get_lines()) == 4 and len(axes["grad norm"].get_lines()) == 2
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_writes_png_beside_the_first_run_and_svg_by_suffix(two_runs, tmp_path, capsys):
    fast, slow = two_runs
    main([str(fast), str(slow / "metrics.jsonl"), "--series", "loss"])  # one panel: a quicker draw
    assert capsys.readouterr().out == f"{fast / 'metrics.png'}\n"
    assert (fast / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    svg = tmp_path / "figures" / "runs.svg"
    main([str(fast), str(slow), "-o", str(svg), "--series", "lr,loss", "--label", "a", "b"])
    assert capsys.readouterr().out == f"{svg}\n"
    assert "<svg" in svg.read_text()


def test_replicas_moe_layers_and_mtp_depths(tmp_path):
    """A fault-tolerant run's folder (replica_<i>/metrics.jsonl, no metrics.jsonl of its own): each
    replica is a run. Per-layer keys are one line per layer per run."""
    rows = [{"step": s, "loss": 8.0 - s, "mtp_loss": [8.5 - s], "moe_imbalance": [1.0 + s, 2.0 + s]} for s in (1, 2)]
    for replica in (0, 1):
        folder = tmp_path / "ft" / f"replica_{replica}"
        folder.mkdir(parents=True)
        lines = [json.dumps(r) for r in rows] + ['{"step": 3, "loss": 5.']  # the last line cut by a kill
        (folder / "metrics.jsonl").write_text("\n".join(lines))
    figure = draw([tmp_path / "ft"], series=["moe_imbalance", "mtp_loss", "grad_norm"])
    assert [ax.get_title() for ax in figure.axes] == ["MoE load imbalance per layer", "multi-token prediction loss"]
    moe = _lines(figure.axes[0])
    assert list(moe) == [f"ft/replica_{r} layer {i}" for r in (0, 1) for i in (0, 1)]
    assert moe["ft/replica_1 layer 1"] == ([1, 2], [3.0, 4.0])
    assert _lines(figure.axes[1])["ft/replica_0 depth 1"] == ([1, 2], [7.5, 6.5])


def test_missing_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / "empty")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plait-plot: no metrics.jsonl in {tmp_path / 'empty'}") and err.count("\n") == 1


def test_missing_matplotlib_is_one_line_naming_the_extra(two_runs, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit) as info:
        main([str(two_runs[0]), "-o", str(two_runs[0] / "none.png")])
    assert info.value.code == 2
    assert capsys.readouterr().err == MISSING_MATPLOTLIB + "\n"
    assert not (two_runs[0] / "none.png").exists()
