"""What the benchmark scripts share: torchtitan's venv and log format, running plait-train.

torchtitan runs from a separate virtual environment (default `benchmarks/.venv`, git-ignored),
created on first use with `--system-site-packages` and `pip install torchtitan==0.3.0` under the
constraint `torch==<this interpreter's torch>`, so torch is never upgraded or replaced; it is
launched through `torchtitan_cpu.py` (patches torchtitan only, to run on CPU), and its tokens/s is
parsed from its per-step log lines (`tps:`). plait runs through `plait-train`; its tokens/s is read
from `<dump_folder>/metrics.jsonl`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TORCHTITAN_VERSION = "0.3.0"
CORPUS_DIR = REPO / "packages" / "data" / "src" / "plait" / "data" / "assets" / "corpus"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TT_STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_torchtitan_venv(venv: Path) -> Path:
    """A venv with torchtitan==0.3.0 that reuses this interpreter's torch (pinned)."""
    python = venv_python(venv)
    check = [str(python), "-c", "import torchtitan, torch, importlib.metadata as m; "
             "print(m.version('torchtitan'), torch.__version__.split('+')[0])"]
    if python.exists():
        out = subprocess.run(check, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split() == [TORCHTITAN_VERSION, torch_version()]:
            return python
    print(f"[bench] creating {venv} with torchtitan=={TORCHTITAN_VERSION}, torch=={torch_version()} pinned",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={torch_version()}\n")
        constraints = f.name
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c", constraints,
                    f"torchtitan=={TORCHTITAN_VERSION}"], check=True)
    os.unlink(constraints)
    out = subprocess.run(check, capture_output=True, text=True, check=True)
    if out.stdout.split() != [TORCHTITAN_VERSION, torch_version()]:
        raise RuntimeError(f"venv {venv} has (torchtitan, torch) = {out.stdout.split()}")
    return python


def plait_records(train_args: list[str], workdir: Path, name: str) -> list[dict]:
    """Run plait-train with `train_args` (dump folder `workdir/name`); its metrics.jsonl rows."""
    dump = workdir / name
    exe = shutil.which("plait-train")
    cmd = [exe] if exe else [sys.executable, "-m", "plait.trainer"]
    cmd += ["--job.dump_folder", str(dump), *train_args]
    log = workdir / f"{name}.log"
    print(f"[bench] {name}: {' '.join(cmd)}\n[bench] log: {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        sys.exit(f"[bench] {name} failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-25:]))
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "tokens_per_second" in row]


def after_warmup(name: str, steps: list[tuple[int, float]], warmup: int) -> list[float]:
    kept = [tps for step, tps in steps if step > warmup]
    if not kept:
        sys.exit(f"[bench] {name}: no step after the {warmup} warmup steps was logged ({steps})")
    print(f"[bench] {name}: tokens/s per step {[round(t) for _, t in steps]}; "
          f"median over steps {warmup + 1}..{max(s for s, _ in steps)}: {statistics.median(kept):.0f}",
          flush=True)
    return kept
