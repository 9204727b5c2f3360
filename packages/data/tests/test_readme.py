"""The README's example, a loop of one's own fed by plait.data, runs as written and learns."""

import re
from pathlib import Path

import torch

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    torch.manual_seed(0)
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(example, str(README), "exec"), {})
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert len(losses) == 3 and losses[-1] < losses[0]
