"""The README's example runs as written, as a script (its ranks import it by name)."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("[(2, 0)]") and "declared: logging the loss" in out.stdout
