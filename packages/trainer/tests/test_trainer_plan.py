"""plait-plan's command line: the same validation and one-line errors as plait-train, the table
and its JSON, the device check. (Layouts that need the parallel packages, a shipped config at its
full world size included: tests/test_combo_trainer_plan_measured.py; the 671B config at 512 ranks,
timed: benchmarks/plan_scale.py.)"""

import json

import pytest

from plait.trainer import cli as train_cli
from plait.trainer.config import ConfigError
from plait.trainer.plan import cli as plan_cli

SMALL = ["--model.n_layers", "2", "--training.local_batch_size", "2", "--training.seq_len", "64"]


def test_plan_flags_are_split_from_the_trainers():
    plan, rest = plan_cli.split_plan_args(
        ["--plan.world_size", "8", "--parallelism.tp", "2", "--plan.device=h200", "--plan.json", "x.json"])
    assert (plan.world_size, plan.device, plan.json, plan.device_memory_gib) == (8, "h200", "x.json", None)
    assert rest == ["--parallelism.tp", "2"]
    for bad, words in ((["--plan.world_size", "0"], "world_size"), (["--plan.device", "a100"], "h100 or h200"),
                       (["--plan.size", "2"], "unknown option"), (["--plan.json"], "needs a value")):
        with pytest.raises(ConfigError, match=words):
            plan_cli.split_plan_args(bad)


BAD_LAYOUTS = {
    "dp_shard_not_world": ["--parallelism.dp_shard", "3"],
    "ep_without_experts": ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
    "tp_not_dividing_kv_heads": ["--parallelism.tp", "2", "--model.n_kv_heads", "1"],
    "cp_not_dividing_seq_len": ["--parallelism.cp", "2", "--training.seq_len", "66"],
}


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_bad_layout_fails_as_plait_train_does(case, tmp_path, capsys):
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, *BAD_LAYOUTS[case]]  # later flags win
    assert train_cli.main(["--nproc-per-node", "2", *flags]) == 2
    trained = capsys.readouterr().err.strip()
    assert plan_cli.main(["--plan.world_size", "2", *flags]) == 2
    planned = capsys.readouterr().err.strip()
    assert trained.startswith("plait-train: error: ") and planned.startswith("plait-plan: error: ")
    assert planned.removeprefix("plait-plan: ") == trained.removeprefix("plait-train: ")
    assert "\n" not in planned


def test_table_json_and_fit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    flags = ["--job.dump_folder", str(tmp_path), *SMALL, "--parallelism.dp_shard", "2", "--plan.world_size", "2"]
    assert plan_cli.main([*flags, "--plan.json", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "peak in" in table and "dp_shard all_gather" in table and "fits in 74.5 GiB" in table
    assert report["fits"] and report["layout"]["dp_shard"] == 2
    memory = report["memory"]
    assert memory["optimizer"] == 2 * memory["parameters"] > 0
    assert memory["peak"] >= memory["parameters"] + memory["optimizer"]
    kinds = {(c["axis"], c["kind"]) for c in report["communication"]}
    assert {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")} <= kinds
    assert report["analytic_estimate"]["model state"] > 0 and report["compute_seconds"] > 0
    # The same layout on a device too small for its peak (with 10% headroom).
    too_small = memory["peak"] / 2**30 * 1.05
    assert plan_cli.main([*flags, "--plan.device_memory_gib", str(too_small)]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def _search(tmp_path, monkeypatch, extra=()):
    """--plan.search over data-parallel layouts only (this session has no tp / cp / pp packages; the
    search would count those as invalid anyway) of the debug model at 2 ranks."""
    from plait.trainer.plan import search as plan_search

    monkeypatch.setattr(plan_search, "MAX_TP", 1)
    monkeypatch.setattr(plan_search, "MAX_CP", 1)
    monkeypatch.setattr(plan_search, "MAX_PP", 1)
    out = tmp_path / "search.json"
    base = ["--job.dump_folder", str(tmp_path), "--model.n_layers", "1", "--training.local_batch_size", "2",
            "--training.seq_len", "32"]
    argv = [*base, "--plan.search", "--plan.world_size", "2", "--plan.json", str(out), *extra]
    return base, argv, out


def test_search_lists_valid_fitting_layouts_by_comm_per_token_as_plait_train_flags(tmp_path, monkeypatch, capsys):
    from plait.trainer.plan.search import traced_comm_per_token
    from plait.trainer.validate import validate

    base, argv, out = _search(tmp_path, monkeypatch)
    assert plan_cli.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    counts, fits = result["counts"], result["fits"]
    # 2 degree layouts (dp_shard 2, dp_replicate 2) x micro-batch 1 x 2 or 2 x 1 x AC none / selective / full.
    assert counts["candidates"] == 12 and counts["invalid"] == 0
    assert counts["traced"] == counts["fit"] == len(fits) == 2  # one per degree layout, the rest are its variants
    assert counts["variants_of_fitting"] == 10 and not result["pp_searched"]
    per_token = [row["comm_bytes_per_token"] for row in fits]
    assert per_token == sorted(per_token) and per_token[0] > 0
    assert "--parallelism.dp_shard 2" in table and "searched: pp <= 1" in table
    for row in fits:
        assert row["report"]["fits"]
        assert row["comm_bytes_per_token"] == traced_comm_per_token(row["report"], 2)
        # The flags go through plait-train's own parser into the same layout, which validates.
        parsed = train_cli.parse_args([*base, *row["flags"]])
        config = plan_cli_config(parsed)
        plan = validate(config, world_size=2)
        layout = row["report"]["layout"]
        assert (plan.dims.dp_replicate, plan.dims.dp_shard, plan.dims.tp) == (layout["dp_replicate"],
                                                                            layout["dp_shard"], layout["tp"])
        t = config.training
        assert [t.local_batch_size, t.seq_len] == row["report"]["micro_batch"]
        assert t.gradient_accumulation_steps == row["report"]["gradient_accumulation_steps"]
        assert t.activation_checkpoint == row["report"]["activation_checkpoint"] == "none"
        # The config's global batch (2 x 2 ranks) is kept.
        assert t.local_batch_size * t.gradient_accumulation_steps * layout["dp_replicate"] * layout["dp_shard"] == 4


def plan_cli_config(parsed):
    from plait.trainer.cli import DEFAULT_CONFIG
    from plait.trainer.config import build_config, load_toml

    return build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)


def test_search_on_a_device_too_small_lists_none(tmp_path, monkeypatch, capsys):
    _, argv, out = _search(tmp_path, monkeypatch, ["--plan.device_memory_gib", "0.001"])
    assert plan_cli.main(argv) == 0
    assert "no traced layout fits" in capsys.readouterr().out
    counts = json.loads(out.read_text())["counts"]
    assert json.loads(out.read_text())["fits"] == []
    # The analytic estimate drops what is over twice the memory; what is traced and does not fit
    # rules out every candidate needing at least its memory.
    assert counts["over_memory"] + counts["do_not_fit"] + counts["heavier_than_not_fitting"] == counts["candidates"]


@pytest.mark.parametrize("extra, words", [
    ([], "--plan.search needs --plan.world_size"),
    (["--plan.world_size", "6"], "powers of two"),
    (["--plan.world_size", "2", "--plan.search_limit", "0"], "--plan.search_limit = '0'"),
    (["--plan.world_size", "2", "--plan.search=maybe"], "--plan.search = 'maybe'"),
])
def test_search_bad_input_is_one_line_and_exit_2(extra, words, tmp_path, capsys):
    assert plan_cli.main(["--job.dump_folder", str(tmp_path), "--plan.search", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plait-plan: error: ") and words in err and "\n" not in err


def test_host_ops_in_json_positive_and_the_same_for_the_same_plan(tmp_path, capsys):
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        assert plan_cli.main(["--job.dump_folder", str(tmp_path), *SMALL, "--plan.json", str(out)]) == 0
    table = capsys.readouterr().out
    first, second = (json.loads(out.read_text()) for out in outs)
    assert 0 < first["host_kernel_ops_per_step"] < first["host_ops_per_step"]
    assert f"host ops per step: {first['host_ops_per_step']} (kernel launches: " in table
    assert sum(first["host_ops_by_op"].values()) == first["host_ops_per_step"]
    assert "aten::mm" in first["host_ops_by_op"] and "aten::_fused_adamw_" in first["host_ops_by_op"]
    for key in ("host_ops_per_step", "host_kernel_ops_per_step", "host_ops_by_op"):
        assert first[key] == second[key], key


def _trace(tmp_path, extra, **kwargs):
    from plait.trainer.plan.trace import trace_step
    from plait.trainer.validate import validate

    config = plan_cli_config(train_cli.parse_args(["--job.dump_folder", str(tmp_path), *SMALL, *extra]))
    return trace_step(config, validate(config, world_size=1), **kwargs)


def _measured_host_ops(rank, world_size, argv):
    from plait.trainer.plan.measure import measured_step

    traced = measured_step(argv)
    return traced.host_ops, traced.host_kernel_ops


def test_host_ops_of_a_plan_are_the_real_steps(tmp_path):
    """The traced step (fake tensors) dispatches the ops a real step of the same layout does: the
    first step's optimizer, which also makes its state, counted as a later step's."""
    from plait.mesh.testing import run_on_ranks

    traced = _trace(tmp_path, [])
    argv = ["--job.dump_folder", str(tmp_path / "real"), *SMALL]
    assert run_on_ranks(_measured_host_ops, 1, argv, timeout=120)[0] == (traced.host_ops, traced.host_kernel_ops)


def test_document_masked_host_ops_do_not_grow_with_documents(tmp_path):
    """A document mask is one attention op per layer, however many documents a row holds."""
    document = ["--model.attention_mask", "document", "--training.seq_len", "256"]
    one, eight = (_trace(tmp_path, document, documents_per_row=n) for n in (1, 8))
    assert one.host_ops == eight.host_ops and one.host_kernel_ops == eight.host_kernel_ops
    assert one.host_ops_by_op == eight.host_ops_by_op


def test_moe_ops_do_not_depend_on_the_tokens_each_expert_receives():
    """Every token routed to the same experts (the others get none) or spread: the same ops."""
    import torch

    from plait.models.moe import MoE, TokenChoiceTopKRouter
    from plait.trainer.plan.host_ops import HostOpCounter

    torch.manual_seed(0)
    moe = MoE(32, 48, 8, 1, TokenChoiceTopKRouter(32, 8, 3, score_func="sigmoid", route_norm=True))
    moe.init_weights(0.02)
    counts = []
    for x in (torch.randn(2, 16, 32), torch.ones(2, 16, 32)):
        moe.zero_grad(set_to_none=True)
        counter = HostOpCounter()
        with counter:
            moe(x.requires_grad_()).sum().backward()
        counts.append(counter.by_op())
    spread, same = counts
    assert spread == same and sum(spread.values()) > 0
