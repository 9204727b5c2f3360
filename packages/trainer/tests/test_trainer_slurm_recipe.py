"""The README's SLURM recipe requeues exactly the runs that resume (issue 53): its own lines, run by
bash against each exit_status plait-train can leave, with `scontrol` stubbed. A first run refused
for its configuration in a new dump folder leaves no file: that must not requeue forever."""

import re
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def _recipe_lines() -> str:
    """The recipe's status and requeue lines, as the README has them."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if "#SBATCH" in b)
    lines = [line for line in block.splitlines() if line.startswith(("status=", "case "))]
    assert len(lines) == 2, lines
    return "\n".join(lines)


@pytest.mark.parametrize(
    "status, requeued",
    [("74", True), ("75", True), ("running", True), (None, False), ("0", False), ("1", False), ("2", False),
     ("3", False), ("4", False), ("5", False)],
)  # fmt: skip
def test_the_recipe_requeues_what_resumes(tmp_path, status, requeued):
    dump = tmp_path / "runs" / "llama3-70b"
    dump.mkdir(parents=True)
    if status is not None:
        (dump / "exit_status").write_text(f"{status}\n")
    script = 'scontrol() { echo "$@" >> requeues; }\nSLURM_JOB_ID=42\n' + _recipe_lines()
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=30)
    calls = (tmp_path / "requeues").read_text().splitlines() if (tmp_path / "requeues").exists() else []
    assert calls == (["requeue 42"] if requeued else []), (status, calls)
