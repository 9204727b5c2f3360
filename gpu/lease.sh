#!/usr/bin/env bash
# One GPU lease that measures everything, prepared: in ONE device call of at most 9 minutes on a
# bare H100 / H200 with the machine's own python (3.12, torch 2.11 CUDA, triton 3.6; no package
# registry there, no nox), then one command here to put the table in benchmarks/RESULTS.md.
#
#   bash gpu/wheels.sh              here first (PyPI): what that python lacks, into .whl (git-ignored)
#   bash gpu/lease.sh               there, as the device call's command: carry [".whl"], timeout_s 540
#   python benchmarks/lease_archive.py <the files that came back> --results benchmarks/RESULTS.md
#                                   here: the raw outputs into benchmarks/leases/<date>-<commit>/ (its
#                                   README), the table regenerated from them and put in RESULTS.md
#   bash gpu/lease.sh --dry-run     on a CPU: every stage but the CUDA work (tests/test_combo_lease_dry_run.py)
#
# Options: --total S (default 520: the whole command), --collectives S (45), --suite S (120),
# --parity S (200), --varlen S (75), --gemm S (30), --plan S (40: at most; what is left); 0 skips
# a stage. --runs CONFIG:MASK:MODE,... (benchmarks/gpu.py's, in priority order), --steps N --warmup N
# (10, 4), --batch-16b N (1: DeepSeek's local batch), --torchtitan-version auto|0.3.0|0.2.2 (auto:
# the one that fits the torch; a dry run here checks 0.2.2's command lines with 0.2.2's parser).
# Arguments after `--` go to pytest (the suite). PLAIT_WHEELS=DIR: another wheel folder than .whl
# (its torchtitan/ and torchtitan-0.2/ subfolders likewise). Everything lands in $OUT (default
# /tmp/plait-gpu; a new temp folder for --dry-run), the only folder a device call brings back:
#   env.txt, stages.tsv   the machine, torch, commit; each stage's exit code, seconds and limit
#   collectives.jsonl     gpu/collectives.py: which collectives gloo runs natively on CUDA tensors
#                         (2 ranks on the GPU), and plait's host-staged send / recv
#   parity.jsonl, .log    gpu/parity.py: the parity matrix's CUDA subset, 2 and 4 ranks sharing the
#                         GPU over gloo, each entry against one rank on it (one line per entry), and
#                         a transformers model under FSDP 2 x TP 2
#   suite.log             gpu/run.py: every CUDA-only branch against its reference (the varlen tests too)
#   signature.txt         plait.models.document_attention.flash_signature(): the varlen signature found
#   varlen.jsonl, .log    benchmarks/bench_varlen.py: one call vs per segment, Llama 3 8B dims, seq 8192
#   bench.jsonl, .log     benchmarks/gpu.py: tokens/s, step time (wall clock and CUDA events), MFU
#   runs/                 (attention whole and halved), peak memory, host launch and GPU busy time
#                         per step of the profiled last step, for plait (eager / compile / CUDA
#                         graphs, causal and document) and torchtitan (causal: 0.3.0 where the torch
#                         is >= 2.12, else 0.2.2; gpu.py picks); each run's last log lines, its
#                         metrics.jsonl and its trace (.trace.json.gz) in runs/
#   gemm.jsonl, .log      benchmarks/gemm_peak.py: bf16 GEMMs at the models' largest shapes (CUDA events)
#   nvidia-smi.txt        nvidia-smi -q idle, and clocks / power / throttle reasons under that GEMM load
#   plan.jsonl, .log      benchmarks/lease_plan.py: plait-plan's peak memory and ideal step per plait run
#   table.md              benchmarks/lease_table.py: all of the above as one dated RESULTS.md section
#
# Budget (TOTAL_S = 520 s for the command; the device call's timeout_s 540 holds it, the machine's
# start is extra). Each stage runs under `timeout`, which signals its whole process group:
#   stage      limit                       expected on an H100 (first lease, 2026-11-27)
#   setup      4 x 120 s (pip)             ~15 s: the wheels into four temp target dirs, env.txt
#   collectives 45 s                       not yet measured (two starts of 2 ranks, more after a crash)
#   suite      120 s                       ~90 s, plus the varlen tests
#   parity     200 s                       not yet measured (~70 short runs; what finished is kept)
#   bench      what is left, less 30 s     the first 4 runs: plait vs torchtitan, compiled, both configs
#   gemm       30 s                        not yet measured (~10 s: 8 GEMMs x 13 calls, 3 s of load)
#   signature  30 s                        ~5 s
#   varlen     75 s                        ~20 s
#   bench_rest what is left, less 30 s     the other 14 runs of ~25-45 s (compile start-up dominates),
#                                          most wanted first; gpu.py starts a run only with 40 s left
#                                          (one run at most 150 s) and records the rest as not run
#   plan       what is left, at most 40 s  not yet measured (CPU: the distinct layouts in parallel); what
#                                          it leaves out: `python benchmarks/lease_plan.py` here after
#   table      15 s                        ~1 s
# Order: what issue 50 needs first (collectives, the suite, parity, plait vs torchtitan), then the rest.
# What that python lacks travels as wheels in .whl: plait's (`datasets` and two of its needs) go in
# one target dir on PYTHONPATH for everything; torchtitan's (with the older `datasets` it pins) in
# another, one per version: 0.3.0's (gpu.py --torchtitan-path) and 0.2.2's (--torchtitan-022-path),
# for torches before 2.12, which 0.3.0 does not import on; gpu.py puts the one that fits this torch
# first on PYTHONPATH for the torchtitan runs only. This checkout's packages go on PYTHONPATH, as
# gpu/run.py does, so nothing is built there.
set -u
cd "$(dirname "$0")/.."
DRY=0 TOTAL_S=520 COLLECTIVES_S=45 SUITE_S=120 PARITY_S=200 VARLEN_S=75 GEMM_S=30 PLAN_S=40 STEPS=10 WARMUP=4 BATCH_16B=1 TT_VERSION=auto
RUNS=llama3-8B:causal:compile,llama3-8B:causal:torchtitan,deepseek-16B:causal:compile,deepseek-16B:causal:torchtitan
RUNS+=,llama3-8B:causal:float8rw,llama3-8B:causal:float8tw,deepseek-16B:causal:float8rw,deepseek-16B:causal:float8x
RUNS+=,llama3-8B:document:compile,deepseek-16B:document:compile
RUNS+=,llama3-8B:causal:chunked,deepseek-16B:causal:chunked,llama3-8B:causal:bf16states,deepseek-16B:causal:bf16states
RUNS+=,llama3-8B:causal:cudagraphs,llama3-8B:document:cudagraphs,deepseek-16B:causal:cudagraphs,deepseek-16B:document:cudagraphs
RUNS+=,deepseek-16B:causal:eager,deepseek-16B:document:eager,llama3-8B:causal:eager,llama3-8B:document:eager
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --total) TOTAL_S=$2; shift ;;
        --collectives) COLLECTIVES_S=$2; shift ;;
        --suite) SUITE_S=$2; shift ;;
        --parity) PARITY_S=$2; shift ;;
        --varlen) VARLEN_S=$2; shift ;;
        --gemm) GEMM_S=$2; shift ;;
        --plan) PLAN_S=$2; shift ;;
        --runs) RUNS=$2; shift ;;
        --steps) STEPS=$2; shift ;;
        --warmup) WARMUP=$2; shift ;;
        --batch-16b) BATCH_16B=$2; shift ;;
        --torchtitan-version) TT_VERSION=$2; shift ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "gpu/lease.sh: unknown argument $1 (see the header of gpu/lease.sh)" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
if [ $DRY = 1 ]; then OUT=${OUT:-$(mktemp -d -t plait-lease-dry-XXXXXX)}; else OUT=${OUT:-/tmp/plait-gpu}; fi
mkdir -p "$OUT"
: >"$OUT/stages.tsv"
START=$SECONDS

stage() {  # stage NAME LIMIT LOG CMD...: CMD under `timeout`, its output to $OUT/LOG and here
    local name=$1 limit=$2 log=$3 t0=$SECONDS rc
    shift 3
    echo "== $name (limit $limit s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$OUT/stages.tsv"
    return 0
}

# ---- setup: the wheels, each folder into a target dir of its own (not under $OUT: that is sent back)
PIP_TAGS=()
if ! $PY -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    # another python (a dry run here): resolve the same cp312 manylinux wheels as the GPU machine's
    PIP_TAGS=(--python-version 3.12 --implementation cp --only-binary=:all:
              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
fi
install_wheels() {  # install_wheels DIR: DIR's wheels into a new temp dir, printed (nothing if none or failed)
    compgen -G "$1/*.whl" >/dev/null || return 0
    local site
    site=$(mktemp -d -t plait-site-XXXXXX)
    if timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${PIP_TAGS[@]}" "$1"/*.whl >&2; then
        echo "$site"
    else
        echo "gpu/lease.sh: installing $1/*.whl failed" >&2
    fi
}
t0=$SECONDS
WHL=${PLAIT_WHEELS:-.whl}  # the test's dry run points it at wheels it made
SITE=$(install_wheels "$WHL")
TT_SITE=$(install_wheels "$WHL/torchtitan")
TT022_SITE=$(install_wheels "$WHL/torchtitan-0.2")
TF_SITE=$(install_wheels "$WHL/transformers")  # the parity stage's transformers model only
trap 'rm -rf "$SITE" "$TT_SITE" "$TT022_SITE" "$TF_SITE"' EXIT
printf 'setup\t0\t%s\t360\n' "$((SECONDS - t0))" >>"$OUT/stages.tsv"
# plait's wheels go on PYTHONPATH where they were built for (the GPU machine); a dry run only
# checks that they install: this python has its own.
[ -n "$SITE" ] && [ ${#PIP_TAGS[@]} = 0 ] && PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
PYTHONPATH=$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "dry_run: $DRY"
    if command -v nvidia-smi >/dev/null; then
        echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
    else
        echo "gpu: none (no nvidia-smi)"
    fi
    $PY -c "
import platform, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'none'
print('python:', platform.python_version()); print('torch:', torch.__version__); print('triton:', tv)"
    commit=$(git rev-parse --short=12 HEAD 2>/dev/null) || commit="unknown (no git)"
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit+=" + uncommitted changes"
    echo "commit: $commit"
    echo "plait wheels: ${SITE:-none}"
    echo "torchtitan: ${TT_SITE:-none}"
    echo "torchtitan 0.2: ${TT022_SITE:-none}"
    echo "transformers: ${TF_SITE:-none}"
    echo "total_s: $TOTAL_S"
    echo "steps: $STEPS"
    echo "warmup: $WARMUP"
    echo "runs: $RUNS"
} 2>&1 | tee "$OUT/env.txt"

# ---- collectives: which collectives gloo runs on CUDA tensors natively, and plait's staged ones
if [ "$COLLECTIVES_S" -gt 0 ]; then
    COLL=(--json "$OUT/collectives.jsonl")
    [ $DRY = 1 ] && COLL+=(--device cpu)
    stage collectives "$COLLECTIVES_S" collectives.log $PY gpu/collectives.py "${COLL[@]}"
fi

# ---- suite: every CUDA-only branch against its reference (a hung test fails at 120 s);
# the dry run collects it (every test module imports), runs none
if [ "$SUITE_S" -gt 0 ]; then
    if [ $DRY = 1 ]; then
        stage suite "$SUITE_S" suite.log $PY gpu/run.py --dry-run-cpu -- --collect-only "${PYTEST_ARGS[@]}"
    else
        stage suite "$SUITE_S" suite.log $PY gpu/run.py -- --timeout=120 --durations=15 "${PYTEST_ARGS[@]}"
    fi
fi

# ---- parity: the parity matrix's CUDA subset, ranks sharing the GPU over gloo (the dry run: one
# entry on the CPU); a transformers model under FSDP 2 x TP 2 first
if [ "$PARITY_S" -gt 0 ]; then
    PARITY=(--jsonl "$OUT/parity.jsonl")
    [ -n "$TF_SITE" ] && PARITY+=(--transformers-path "$TF_SITE")
    [ $DRY = 1 ] && PARITY+=(--dry-run-cpu)
    stage parity "$PARITY_S" parity.log $PY gpu/parity.py "${PARITY[@]}" -- --timeout=$((PARITY_S - 10))
fi

# ---- bench: plait and torchtitan training steps, in RUNS order, until the budget is spent: the
# first four (plait vs torchtitan, compiled, both configs) before the varlen stages, the rest after
bench() {  # bench STAGE RUNS
    local left=$((TOTAL_S - (SECONDS - START) - 30))
    if [ "$left" -le 60 ]; then
        printf '%s\tskipped\t0\t%s\n' "$1" "$left" >>"$OUT/stages.tsv"
        return 0
    fi
    BENCH=(--runs "$2" --steps "$STEPS" --warmup "$WARMUP" --batch-16b "$BATCH_16B" --profile --no-results --deadline $((left - 25))
           --run-timeout 150 --min-run-s 40 --json "$OUT/bench.jsonl" --logs "$OUT/runs" --torchtitan-version "$TT_VERSION"
           --tt-tokenizer "$(realpath -m "$WHL/torchtitan-tokenizer")")
    [ -n "$TT_SITE" ] && BENCH+=(--torchtitan-path "$TT_SITE")
    [ -n "$TT022_SITE" ] && BENCH+=(--torchtitan-022-path "$TT022_SITE")
    [ $DRY = 1 ] && BENCH+=(--dry-run)
    stage "$1" "$left" "$1.log" $PY benchmarks/gpu.py "${BENCH[@]}"
}
FIRST_RUNS=$(echo "$RUNS" | cut -d, -f1-4)
REST_RUNS=$(echo "$RUNS" | cut -s -d, -f5-)
bench bench "$FIRST_RUNS"

# ---- gemm: what the GPU reaches (bf16 GEMMs at the models' shapes), nvidia-smi -q idle and under that load
if [ "$GEMM_S" -gt 0 ]; then
    GEMM=(--json "$OUT/gemm.jsonl" --smi "$OUT/nvidia-smi.txt" --batch-16b "$BATCH_16B")
    [ $DRY = 1 ] && GEMM+=(--dry-run)
    stage gemm "$GEMM_S" gemm.log $PY benchmarks/gemm_peak.py "${GEMM[@]}"
fi

# ---- signature: which varlen signature the op found in this torch
stage signature 30 signature.txt $PY -c \
    "from plait.models.document_attention import flash_signature; print(flash_signature())"

# ---- varlen: one call vs per segment, Llama 3 8B dims, seq 8192, bf16, forward and backward
if [ "$VARLEN_S" -gt 0 ]; then
    DEVICE=()
    [ $DRY = 1 ] && DEVICE=(--device cpu --dry-run)
    stage varlen "$VARLEN_S" varlen.log $PY benchmarks/bench_varlen.py --json "$OUT/varlen.jsonl" "${DEVICE[@]}"
fi

[ -n "$REST_RUNS" ] && bench bench_rest "$REST_RUNS"

# ---- plan: plait-plan's peak memory and step for each plait run (CPU), in what is left (the dry run: the first)
PLAN_LEFT=$((TOTAL_S - (SECONDS - START) - 20))
[ "$PLAN_LEFT" -gt "$PLAN_S" ] && PLAN_LEFT=$PLAN_S
[ $DRY = 1 ] && PLAN_LEFT=150  # one plan on a CPU that may be shared: no budget to keep
if [ "$PLAN_S" -gt 0 ] && [ "$PLAN_LEFT" -ge 15 ]; then
    PLAN=(--deadline $((PLAN_LEFT - 5)))
    [ $DRY = 1 ] && PLAN+=(--dry-run)
    stage plan "$PLAN_LEFT" plan.log $PY benchmarks/lease_plan.py "$OUT" "${PLAN[@]}"
elif [ "$PLAN_S" -gt 0 ]; then
    printf 'plan\tskipped\t0\t%s\n' "$PLAN_LEFT" >>"$OUT/stages.tsv"
fi

# ---- table: all of it as one RESULTS.md section, $OUT/table.md
stage table 15 table.log $PY benchmarks/lease_table.py "$OUT"
echo "gpu/lease.sh: $((SECONDS - START)) s; out: $OUT"
exit 0
