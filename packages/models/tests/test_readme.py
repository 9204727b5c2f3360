"""The README's example runs as written."""

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(example, str(README), "exec"), {})
    assert "layers.0" in capsys.readouterr().out
