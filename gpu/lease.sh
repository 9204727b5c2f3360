#!/usr/bin/env bash
# One short GPU lease, prepared: the GPU suite, then the bf16 benchmark (eager / compile / CUDA graphs),
# with the GPU machine's own python (no package registry there, no nox).
#
#   bash gpu/lease.sh [SUITE_S] [BENCH_S] [PYTEST_ARGS...]    each stage bounded by `timeout` (0 skips
#                                                              it), logs under $OUT
#
# What that python lacks (`datasets` and the two packages it needs beyond the image) travels as
# wheels in .whl (git-ignored): `bash gpu/wheels.sh` here first, then carry .whl. This checkout's
# packages go on PYTHONPATH, as gpu/run.py does, so nothing is built there. The first lease
# (2026-11-27, H100): the suite takes ~90 s, each benchmark run ~35 s, the machine's start ~30 s:
# the defaults (150 s + 330 s) fit a device call with timeout_s 520, and leave room for one rerun.
set -u
OUT=${OUT:-/tmp/plait-gpu}
SUITE_S=${1:-150}
BENCH_S=${2:-330}
shift 2 2>/dev/null
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d)  # not under $OUT: what is there is sent back
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
PYTHONPATH=$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    git rev-parse --short=12 HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

# Each stage under `timeout`, which signals its whole process group at the limit: the pytest and
# plait-train processes it started go with it.
# Stage 1: every CUDA-only branch against its reference (a hung test fails at 200 s).
[ "$SUITE_S" -gt 0 ] && timeout -k 10 "$SUITE_S" python3 gpu/run.py -- --timeout=200 --durations=25 "$@" 2>&1 | tee "$OUT/suite.log"

# Stage 2: bf16 tokens/s and MFU, DeepSeek-V3 16B dims (4 layers) and Llama 3 8B dims (8 layers)
# in eager / compile / CUDA graphs, causal (torchtitan's default) and the shipped document mask;
# each run's last step profiled: host time vs GPU busy time. Short runs: medians after the warmup.
[ "$BENCH_S" -gt 0 ] && timeout -k 10 "$BENCH_S" bash -c '
    bench="python3 benchmarks/gpu.py --steps 12 --warmup 5 --no-results --profile"
    $bench --only llama3-8B --modes compile,cudagraphs
    $bench --only deepseek-16B --modes eager,compile,cudagraphs
    $bench --only llama3-8B,deepseek-16B --modes compile --attention-mask document
' 2>&1 | grep -v "^\[gpu\] .*: .*-m plait.trainer" | tee "$OUT/bench.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$OUT/env.txt" 2>&1
exit 0
