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
