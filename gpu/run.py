"""The GPU suite in one command: every CUDA-only branch of plait against its CPU or math reference.

    python gpu/run.py                  on a CUDA machine (`nox -s gpu` runs this)
    python gpu/run.py --dry-run-cpu    the same tests on the CPU, cuda_only ones skipped
    python gpu/run.py -- -k moe        extra arguments after `--` go to pytest

On a machine without CUDA (and without --dry-run-cpu) it prints one line and exits 0. Otherwise it
runs pytest over gpu/ and ends with one summary line: device, torch, passed / failed / skipped,
wall time. It tests this checkout's packages (their src folders go first on PYTHONPATH, so nothing
needs installing: the GPU machines have no package registry) with the python that runs it, which
must have torch (CUDA build) and pytest; safetensors and triton where the tests use them.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _counts(report: Path) -> dict[str, int]:
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    if not report.exists():
        return totals
    for suite in ET.parse(report).getroot().iter("testsuite"):
        tests, failures, errors = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors"))
        skipped = int(suite.get("skipped", 0))
        totals["failed"] += failures + errors
        totals["skipped"] += skipped
        totals["passed"] += tests - failures - errors - skipped
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run-cpu", action="store_true", help="run on the CPU, skipping cuda_only tests")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print(f"plait GPU suite: no torch in {sys.executable}: nothing run.")
        return 0
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print(f"plait GPU suite: no CUDA device on this machine (torch {torch.__version__}): nothing run.")
        return 0
    device = "cpu (dry run)" if args.dry_run_cpu else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "gpu.xml"
        cmd = [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={report}", "-o", "junit_family=xunit2", "--rootdir", str(HERE)]  # fmt: skip
        if args.dry_run_cpu:
            cmd.append("--dry-run-cpu")
        src = [str(p) for p in sorted((HERE.parent / "packages").glob("*/src"))]
        env = {"PYTHONHASHSEED": "0", **os.environ}
        env["PYTHONPATH"] = os.pathsep.join([*src, *filter(None, [os.environ.get("PYTHONPATH")])])
        start = time.perf_counter()
        rc = subprocess.call([*cmd, *args.pytest_args], env=env)
        totals = _counts(report)
    wall = time.perf_counter() - start
    print(
        f"plait GPU suite: {device}, torch {torch.__version__}: {totals['passed']} passed, {totals['failed']} failed, "
        f"{totals['skipped']} skipped in {wall:.0f} s"
    )
    return 0 if rc == 0 and not totals["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
