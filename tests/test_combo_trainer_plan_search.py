"""plait-plan --plan.search with every parallel package installed: on the DeepSeek-V3 debug model
(MoE) at 4 ranks it searches pp, tp, cp, ep and etp too; what it lists validates as plait-train
would, fits, comes sorted by bytes per token, and the flags give back the traced layout."""

import json

from plait.plan import cli as plan_cli
from plait.trainer import cli as train_cli
from plait.trainer.cli import DEFAULT_CONFIG
from plait.trainer.config import build_config, load_toml
from plait.trainer.validate import validate

DEEPSEEK = ["--config", "deepseek_v3_debugmodel.toml", "--model.n_layers", "2", "--training.local_batch_size", "2",
            "--training.seq_len", "32"]
DEGREES = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "ep", "etp")


def test_search_over_every_axis_lists_valid_fitting_layouts_in_order(tmp_path, capsys):
    out = tmp_path / "search.json"
    base = [*DEEPSEEK, "--job.dump_folder", str(tmp_path)]
    assert plan_cli.main([*base, "--plan.search", "--plan.world_size", "4", "--plan.search_limit", "4",
                          "--plan.json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    counts, fits = result["counts"], result["fits"]
    assert result["pp_searched"] and "searched: pp <= 8" in table
    assert counts["traced"] == 4 and counts["fit"] == len(fits) >= 2 and counts["not_traced_limit"] > 0
    per_token = [row["comm_bytes_per_token"] for row in fits]
    assert per_token == sorted(per_token)
    seen = set()
    for row in fits:
        assert row["report"]["fits"]
        parsed = train_cli.parse_args([*base, *row["flags"]])
        config = build_config(load_toml(parsed.config or DEFAULT_CONFIG), parsed.overrides)
        plan = validate(config, world_size=4)
        layout = row["report"]["layout"]
        assert {d: getattr(plan.dims, d) for d in DEGREES} == {d: layout[d] for d in DEGREES}
        seen |= {d for d in ("pp", "tp", "cp", "ep") if layout[d] > 1}
    # The search is not only data parallel: the cheapest layouts of an MoE model use its other axes.
    assert seen
