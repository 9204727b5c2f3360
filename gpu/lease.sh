#!/usr/bin/env bash
# One short GPU lease, prepared: the GPU suite, then the bf16 benchmark (eager / compile / CUDA graphs),
# with the GPU machine's own python (no package registry there, no nox).
#
#   bash gpu/lease.sh [SUITE_S] [BENCH_S] [PYTEST_ARGS...]    each stage bounded by `timeout` (0 skips
#                                                              it), logs under $OUT
#
# What that python lacks (`datasets` and the two packages it needs beyond the image) travels as
# wheels in .whl (git-ignored; `pip download --no-deps --python-version 3.12 ... datasets dill
# multiprocess`, see the device tool's README). This checkout's packages go on PYTHONPATH, as
# gpu/run.py does, so nothing is built there.
set -u
OUT=${OUT:-/tmp/plait-gpu}
SUITE_S=${1:-240}
BENCH_S=${2:-240}
shift 2 2>/dev/null
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PYTHONPATH=$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    git rev-parse --short=12 HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

# Stage 1: every CUDA-only branch against its reference (a hung test fails at 200 s).
[ "$SUITE_S" -gt 0 ] && timeout -k 10 "$SUITE_S" python3 gpu/run.py -- --timeout=200 --durations=25 "$@" 2>&1 | tee "$OUT/suite.log"
pkill -9 -f "pytest|plait.trainer" 2>/dev/null

# Stage 2: bf16 tokens/s and MFU, DeepSeek-V3 16B dims (4 layers) in three modes, Llama 3 8B dims
# (8 layers) compiled. Short runs: the medians of the steps after the warmup.
[ "$BENCH_S" -gt 0 ] && timeout -k 10 "$BENCH_S" bash -c '
    python3 benchmarks/gpu.py --only deepseek-16B --modes eager,compile,cudagraphs --steps 12 --warmup 5 --no-results
    python3 benchmarks/gpu.py --only llama3-8B --modes compile --steps 12 --warmup 5 --no-results
' 2>&1 | tee "$OUT/bench.log"
pkill -9 -f "plait.trainer" 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$OUT/env.txt" 2>&1
exit 0
