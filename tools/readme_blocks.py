"""The ```python blocks of the project's markdown (README.md, packages/*/README.md, docs/*.md) and
what each one is (issue 55). The line right before each block is a marker, invisible when rendered:

    <!-- runs: python -->            a complete program, run as printed: `python block.py`
    <!-- runs: torchrun 2 -->        the same under `torchrun --standalone --nproc-per-node 2` (any N)
    <!-- fragment: why -->           a sketch naming what is defined elsewhere (the why in a few words)

tests/test_combo_readme_blocks.py fails on a block without one and runs every `runs:` block.

    python tools/readme_blocks.py    one line per block (file:line marker), exit 1 if one has none

`blocks(path)` returns one file's blocks for the test.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- (runs: python|runs: torchrun [1-9][0-9]*|fragment: \S.*?) -->$")


class Block(NamedTuple):
    path: Path
    line: int  # the opening fence's, 1-based
    kind: str | None  # the marker's text ("runs: python", "runs: torchrun 2", "fragment: ..."); None: no marker
    code: str  # dedented as far as the fence is (a block inside a list item)

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"

    @property
    def ranks(self) -> int | None:
        """None for `runs: python` and fragments; N for `runs: torchrun N`."""
        return int(self.kind.rsplit(" ", 1)[1]) if self.kind and self.kind.startswith("runs: torchrun") else None


def markdown_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted(root.glob("packages/*/README.md")), *sorted(root.glob("docs/*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = Path(path).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
        if fence == "```python":
            marker = MARKER.match(lines[i - 1].strip()) if i else None
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            found.append(Block(Path(path), i + 1, marker and marker.group(1), code))
        i = end + 1  # a fence of another language is skipped whole: its lines are no fences
    return found


def main() -> int:
    missing = 0
    for path in markdown_files():
        for block in blocks(path):
            print(block.where, block.kind or "NO MARKER: put <!-- runs: python --> or <!-- fragment: why --> before it")
            missing += block.kind is None
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
