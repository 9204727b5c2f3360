"""The README's example runs as written: a lighthouse, two replica groups as processes, five
steps with both groups in every quorum."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


@pytest.mark.timeout(150)
def test_readme_example_runs(tmp_path):
    script = tmp_path / "ft_example.py"
    script.write_text(re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=140,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout
    assert done.returncode == 0 and "exit codes [0, 0]" in out, out + done.stderr[-3000:]
    steps = re.findall(r"group (\d) step (\d+) groups (\d+) loss ([\d.]+)", out)  # the groups' lines interleave
    for r in "01":
        mine = [(int(step), groups, float(loss)) for g, step, groups, loss in steps if g == r]
        assert [s for s, _, _ in mine] == [1, 2, 3, 4, 5] and {g for _, g, _ in mine} == {"2"}, out
        assert mine[-1][2] < mine[0][2], out
