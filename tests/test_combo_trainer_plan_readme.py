"""The planner README's first example, as printed, on a machine with no tokenizer file or dataset
(issue 40: it stopped with "tokenizer file not found"). A combo test: the 671B config's layout
needs plait-expertparallel and plait-pipelineparallel installed."""

from plait.plan import cli as plan_cli


def test_the_readme_plan_of_deepseek_v3_671B_needs_no_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert plan_cli.main(["--config", "deepseek_v3_671B.toml", "--plan.world_size", "512"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("plait-plan: deepseek_v3 671B on 512 ranks") and "fits in" in table
