"""plait-plan --plan.max_batch: each AC mode's largest local batch that fits, found by traces of the
real planner and checked against it (the batch fits, one more does not); the search's steps and
bounds on a stand-in planner; the refusals and the JSON."""

import contextlib
import io
import json

import pytest

from plait.plan import cli as plan_cli
from plait.plan import max_batch
from plait.plan import search as plan_search
from plait.plan.devices import GIB
from plait.plan.report import HEADROOM
from plait.trainer.config import build_config, load_toml

# Two layers at seq 1024 in bf16: traced peaks (MiB) full 46 / 98 / 163 at batch 1 / 2 / 4, none 96 /
# 155 at 1 / 2; 0.14 GiB (129 MiB usable) makes the answers a few sequences.
TINY = ["--model.n_layers", "2", "--training.seq_len", "1024", "--training.dtype", "bfloat16",
        "--model.tokenizer_path", ""]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """One --plan.max_batch run of the tiny model on one rank: its table, JSON and flags (module-wide:
    capsys is per test)."""
    tmp = tmp_path_factory.mktemp("max_batch")
    out = tmp / "max_batch.json"
    argv = ["--job.dump_folder", str(tmp), *TINY, "--plan.max_batch", "--plan.device_memory_gib", "0.14",
            "--plan.json", str(out)]
    table = io.StringIO()
    with contextlib.redirect_stdout(table), contextlib.redirect_stderr(io.StringIO()):
        assert plan_cli.main(argv) == 0
    return table.getvalue(), json.loads(out.read_text()), argv


def _plan(argv: list[str], ac: str, batch: int) -> dict:
    """The planner's own verdict at this batch and mode (a forked child, as plait-plan traces)."""
    args, rest = plan_cli.split_plan_args([a for a in argv if a != "--plan.max_batch"])
    from plait.trainer.cli import parse_args

    config = build_config(load_toml("llama3_debugmodel.toml"),
                          parse_args([*rest, "--training.local_batch_size", str(batch),
                                      "--training.activation_checkpoint", ac]).overrides)
    return plan_search._trace_in_child(config, args)


def test_the_batch_found_fits_and_one_more_does_not(found):
    table, result, argv = found
    best = result["recommended"]
    assert best["local_batch_size"] >= 2  # the memory was chosen for a few sequences
    assert _plan(argv, best["activation_checkpoint"], best["local_batch_size"])["fits"]
    assert not _plan(argv, best["activation_checkpoint"], best["local_batch_size"] + 1)["fits"]
    assert f"--training.local_batch_size {best['local_batch_size']} --training.activation_checkpoint" in table


def test_modes_are_ordered_and_every_answer_is_a_trace(found):
    table, result, _ = found
    modes = {m["ac"]: m for m in result["modes"]}
    assert modes["full"]["local_batch_size"] >= modes["selective"]["local_batch_size"] >= modes["none"]["local_batch_size"]
    assert modes["none"]["local_batch_size"] >= 1
    traced = {(t["ac"], t["local_batch_size"]): t["fits"] for t in result["traces"]}
    for m in result["modes"]:
        # The answer was traced and fits; the next batch was traced in this mode or a lighter one and did not.
        assert traced[(m["ac"], m["local_batch_size"])] and m["report"]["fits"]
        lighter = max_batch.AC_MODES[:max_batch.AC_MODES.index(m["ac"]) + 1]
        assert any(traced.get((ac, m["local_batch_size"] + 1)) is False for ac in lighter)
        assert m["peak"] <= result["usable_gib"] * 2**30
        assert m["tokens_per_gpu_per_step"] == m["local_batch_size"] * 1024  # one rank, no accumulation
    assert len(result["traces"]) <= 12  # interpolation and bisection, not a scan
    assert result["configured"] == {"activation_checkpoint": "none", "local_batch_size": 8,
                                    "tokens_per_gpu_per_step": 8 * 1024, "fits": False}
    assert "which does not fit" in table and "largest local batch" in table


def test_no_batch_fits_is_one_line_with_the_smallest_peak(tmp_path, capsys):
    out = tmp_path / "none.json"
    argv = ["--job.dump_folder", str(tmp_path), *TINY, "--plan.max_batch", "--plan.device_memory_gib", "0.04",
            "--plan.json", str(out)]
    assert plan_cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("no local batch fits: the smallest peak traced is") and "AC full" in lines[-1]
    result = json.loads(out.read_text())
    # Full AC at batch 1 does not fit, so no heavier mode is traced.
    assert result["recommended"] is None and len(result["traces"]) == 1
    assert result["smallest_peak"]["local_batch_size"] == 1


class _StandIn:
    """A planner whose peak is batch x seq_len x a per-mode factor (bytes): the search's steps and
    bounds without tracing. Records the batches asked."""

    FACTOR = {"none": 4, "selective": 2, "full": 1}  # bytes per token

    def __init__(self, usable: float):
        self.usable, self.asked = usable, []

    def __call__(self, config, plan_args):
        t = config.training
        self.asked.append((t.activation_checkpoint, t.local_batch_size))
        peak = t.local_batch_size * t.seq_len * self.FACTOR[t.activation_checkpoint]
        return {"memory": {"peak": peak}, "fits": peak <= self.usable}


def _stand_in_search(monkeypatch, usable: float, flags=()):
    """max_batch over the stand-in, on a device whose usable memory is `usable` bytes (plus half a
    sequence of full AC at seq 256, so that no answer sits on a rounding edge)."""
    memory_gib = (usable + 128) / GIB / (1 - HEADROOM)
    planner = _StandIn(memory_gib * (1 - HEADROOM) * GIB)  # max_batch's arithmetic
    monkeypatch.setattr(plan_search, "_trace_in_child", planner)
    config = build_config(load_toml("llama3_debugmodel.toml"), [("model.tokenizer_path", ""), *flags])
    return max_batch.max_batch(config, plan_cli.PlanArgs(device_memory_gib=memory_gib)), planner


def test_the_search_interpolates_and_heavier_modes_stay_below(monkeypatch):
    result, planner = _stand_in_search(monkeypatch, usable=100 * 256)  # full 100, selective 50, none 25
    assert [(m.ac, m.local_batch_size) for m in result.modes] == [("full", 100), ("selective", 50), ("none", 25)]
    # Full: 1 and 2 give the line, which meets the memory at 100; 101 closes the bracket.
    assert [b for ac, b in planner.asked if ac == "full"] == [1, 2, 100, 101]
    # Selective: 1 does not halve 1..100 (full's bound), so a bisection (51), then the line hits 50.
    assert [b for ac, b in planner.asked if ac == "selective"] == [1, 51, 50]
    assert [b for ac, b in planner.asked if ac == "none"] == [1, 26, 25]


def test_a_peak_that_is_not_linear_still_ends_in_a_one_sequence_bracket(monkeypatch):
    """Quadratic peaks (batch^2 x 256 bytes): the line errs, the bisections bound the traces."""

    def squared(config, plan_args):
        batch = config.training.local_batch_size
        asked.append(batch)
        return {"memory": {"peak": batch * batch * 256}, "fits": batch * batch * 256 <= usable}

    asked, memory_gib = [], 5000.5 * 256 / GIB / (1 - HEADROOM)
    usable = memory_gib * (1 - HEADROOM) * GIB
    monkeypatch.setattr(plan_search, "_trace_in_child", squared)
    config = build_config(load_toml("llama3_debugmodel.toml"), [("model.tokenizer_path", "")])
    result = max_batch.max_batch(config, plan_cli.PlanArgs(device_memory_gib=memory_gib))
    assert [m.local_batch_size for m in result.modes] == [70, 70, 70]  # 70^2 <= 5000 < 71^2
    assert len(asked) <= 3 * 12


def test_forwarded_flags_change_the_answer(monkeypatch):
    """Flags plait-plan does not know reach plait-train's parser and the traced config unchanged."""
    plan, rest = plan_cli.split_plan_args(["--plan.max_batch", "--training.loss", "chunked", "--plan.device=h200"])
    assert plan.max_batch and plan.device == "h200" and rest == ["--training.loss", "chunked"]
    short, _ = _stand_in_search(monkeypatch, usable=100 * 256)
    long, _ = _stand_in_search(monkeypatch, usable=100 * 256, flags=[("training.seq_len", "512")])
    assert long.recommended().local_batch_size == short.recommended().local_batch_size // 2


def test_pipeline_batches_move_in_whole_pipeline_steps_up_to_the_cap(monkeypatch):
    config = build_config(load_toml("llama3_debugmodel.toml"), [("parallelism.pp", "2"),
                                                               ("parallelism.pipeline_microbatch_size", "2")])
    assert max_batch.batch_step(config) == 4
    planner = _StandIn(usable=float("inf"))
    monkeypatch.setattr(plan_search, "_trace_in_child", planner)
    result = max_batch.MaxBatchResult(world_size=2, step=4, usable=float("inf"))
    mode, bound = max_batch._largest(config, None, "full", None, result, None)
    assert mode.capped and mode.local_batch_size == max_batch.MAX_LOCAL_BATCH and bound is None
    assert all(b % 4 == 0 for _, b in planner.asked)


@pytest.mark.parametrize("flags, words", [
    (["--plan.search", "--plan.world_size", "2"], "--plan.max_batch and --plan.search"),
    (["--plan.search_limit", "3"], "--plan.search_limit bounds --plan.search"),
    (["--plan.max_batch=maybe"], "--plan.max_batch = 'maybe'"),
])
def test_max_batch_refusals_are_one_line_and_exit_2(flags, words, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plan_search, "_trace_in_child", pytest.fail)  # refused before any trace
    assert plan_cli.main(["--job.dump_folder", str(tmp_path), "--plan.max_batch", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plait-plan: error: ") and words in err and "\n" not in err



def test_two_nearly_equal_peaks_double_instead_of_drawing_a_line_to_the_cap():
    """DeepSeek-V3 16B at full AC: batches 1 and 2 both peak at the model state (29.26 GiB); a line
    through them reached the 1024 ceiling, an 8-minute trace. Rows that add under 1% double."""
    from plait.plan.max_batch import _next_probe

    assert _next_probe({1: 29.26, 2: 29.27}, lo=2, hi=None, top=1024, usable=67.1) == 4
    assert _next_probe({1: 15.02, 2: 22.78}, lo=2, hi=None, top=1024, usable=67.1) == 7  # the line
