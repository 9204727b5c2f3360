"""Small pieces (issue 41): no file over 400 lines and no function over 60 in packages/*/src.

A function counts from its `def` (decorators excluded) to its last line, docstring included; a
nested function counts inside its parent too.

    python tools/size_limits.py            one line per problem, exit 1 if any (the lint session)

`problems(root)` returns them for a test (tests/test_combo_size_limits.py).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def problems(root: Path = ROOT) -> list[str]:
    found = []
    for file in sorted((root / "packages").glob("*/src/**/*.py")):
        text = file.read_text()
        where = file.relative_to(root)
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{where}: {lines} lines, over {MAX_FILE_LINES}: split it into modules with one job each")
        for node in ast.walk(ast.parse(text, str(file))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno}: {node.name} is {length} lines, over "
                                 f"{MAX_FUNCTION_LINES}: split it into functions with one job each")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(f"size_limits: {line}")
    if not found:
        print(f"size_limits: no file over {MAX_FILE_LINES} lines, no function over {MAX_FUNCTION_LINES}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
