"""plait-plan at scale: the DeepSeek-V3 671B config planned for 512 ranks on this machine.

    python benchmarks/plan_scale.py [--config deepseek_v3_671B.toml] [--world-size 512]

Issue 24's bar is under a minute and under 4 GiB on 2 cores. Runs `plait-plan` in a subprocess (one
thread), prints its wall time, its peak resident memory and the plan's headline figures. A
measurement, not a test: timings depend on the machine (the test suite checks what the plan
says on small layouts against measured steps: packages/trainer/tests/test_trainer_plan*.py).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek_v3_671B.toml")
    parser.add_argument("--world-size", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        start = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "plait.plan.cli", "--config", args.config, "--plan.world_size",
             str(args.world_size), "--model.tokenizer_path", "", "--job.dump_folder", tmp, "--plan.json", str(out)],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800,
        )  # fmt: skip
        seconds = time.monotonic() - start
        if result.returncode:
            sys.exit(f"plait-plan failed ({result.returncode}): {result.stderr[-2000:]}")
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB  # KiB on Linux
        report = json.loads(out.read_text())
    memory = report["memory"]
    print(f"{args.config} at {args.world_size} ranks: planned in {seconds:.1f} s, peak RSS {rss:.2f} GiB "
          f"(bar: < 60 s, < 4 GiB)")  # fmt: skip
    print(f"per rank: parameters {memory['parameters'] / GIB:.2f} GiB, optimizer {memory['optimizer'] / GIB:.2f} GiB, "
          f"peak {memory['peak'] / GIB:.2f} GiB; host syncs {report['host_syncs']}; fits: {report['fits']}")


if __name__ == "__main__":
    main()
