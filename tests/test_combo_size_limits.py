"""No file over 400 lines and no function over 60 in packages/*/src (tools/size_limits.py); the
check fails on a deliberately long function and a long file."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("size_limits", ROOT / "tools" / "size_limits.py")
size_limits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(size_limits)


def test_the_limits_hold_on_main():
    assert size_limits.problems(ROOT) == []


def test_a_long_function_and_a_long_file_fail(tmp_path: Path):
    folder = tmp_path / "packages" / "data" / "src" / "plait" / "data"
    folder.mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(60))  # def + 60 lines: 61
    (folder / "loader.py").write_text(f"def build():\n{body}")
    (folder / "stream.py").write_text("x = 1\n" * 401)
    found = size_limits.problems(tmp_path)
    assert len(found) == 2
    assert "loader.py:1: build is 61 lines, over 60" in found[0]
    assert "stream.py: 401 lines, over 400" in found[1]
