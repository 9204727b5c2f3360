"""The README's example runs as written: a checkpoint saved, published, verified, exported to HF
and read back."""

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(example, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "'config.json', 'model.safetensors'" in out and out.strip().endswith("True")
