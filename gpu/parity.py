"""The parity matrix's CUDA subset on this GPU: 2 and 4 ranks sharing it over gloo, each entry
against one rank on the same GPU (tests/test_combo_parity_matrix.py, PLAIT_PARITY_DEVICE=cuda).

    python gpu/parity.py --jsonl OUT/parity.jsonl              the lease's `parity` stage, nox -s gpu
    python gpu/parity.py --jsonl OUT/parity.jsonl --dry-run-cpu one entry on the CPU (the dry run)

One JSON line per entry lands in --jsonl as the entry finishes (layout, model, dtype, ranks, the
largest loss / grad-norm / gradient differences, host syncs per step, passed), so what finished is
kept when the lease's time runs out. Without CUDA (and without --dry-run-cpu): one line, exit 0.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MATRIX = "tests/test_combo_parity_matrix.py"
DRY_RUN_ENTRY = f"{MATRIX}::test_layout_matches_its_reference[llama3-fp32-2-fsdp_2]"


def summary(jsonl: Path) -> str:
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    failed = [f"{r['model']} {r['dtype']}: {r['layout']}" for r in records if not r["passed"]]
    return f"{len(records) - len(failed)} of {len(records)} entries passed" + (f"; failed: {'; '.join(failed)}" if failed else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path, required=True, help="one JSON line per entry, appended")
    parser.add_argument("--dry-run-cpu", action="store_true", help="one entry on the CPU instead")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print(f"plait CUDA parity: no CUDA device (torch {torch.__version__}): nothing run.")
        return 0
    args.jsonl.parent.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **os.environ, "PLAIT_PARITY_JSONL": str(args.jsonl.resolve())}
    env["PLAIT_PARITY_DEVICE"] = "cpu" if args.dry_run_cpu else "cuda"
    src = [str(p) for p in sorted((REPO / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, *filter(None, [os.environ.get("PYTHONPATH")])])
    target = DRY_RUN_ENTRY if args.dry_run_cpu else MATRIX
    cmd = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", "-rf", *args.pytest_args]
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    device = "cpu (dry run)" if args.dry_run_cpu else torch.cuda.get_device_name(0)
    print(f"plait CUDA parity: {device}, torch {torch.__version__}: {summary(args.jsonl)} "
          f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
