#!/usr/bin/env bash
# What the GPU machines' python (3.12, x86_64, torch 2.11 CUDA, no package registry) lacks, into
# .whl (git-ignored): run here, where PyPI is reachable, before a lease, then carry .whl with the
# lease call; gpu/lease.sh installs each folder into a target dir of its own (--no-deps, --no-index).
#
#   .whl/*.whl                   plait-train's: `datasets` and the two packages it needs beyond the
#                                image (which has pyarrow, pandas, fsspec, huggingface-hub, xxhash,
#                                tqdm, pyyaml), and torchao for training.float8 (the float8 runs)
#   .whl/torchtitan/*.whl        torchtitan 0.3.0 and what it imports on the benchmark's path that the
#                                image lacks, with the older `datasets` it pins (<4.8) and that
#                                datasets' own dill / multiprocess: a folder of its own, put on
#                                PYTHONPATH for the torchtitan runs only, so it never shadows plait's
#   .whl/torchtitan-0.2/*.whl    torchtitan 0.2.2 and the same set less 0.3.0's own two (spmd_types,
#                                torch_checkpointing): 0.3.0 imports torch.distributed.fsdp's
#                                DataParallelMeshDims, new in torch 2.12, so on the image's torch 2.11
#                                benchmarks/gpu.py runs 0.2.2, the last release without it
#   .whl/torchtitan-tokenizer/   the tokenizer torchtitan's runs read (from shared/bench)
#   .whl/transformers/*.whl      transformers 5.24 (the version the CPU suite tests) and what it needs
#                                that the image may lack: the parity stage's transformers model only
#                                (gpu/parity.py --transformers-path), a folder of its own so that its
#                                huggingface_hub never shadows plait's for the other stages. typer
#                                (its command line) is left out: `import transformers` does not need it
#
# The torchtitan set is torchtitan 0.3.0's Requires-Dist (`pip download torchtitan==0.3.0 --no-deps`,
# its METADATA) resolved for cp312 manylinux, less torch / triton / the nvidia libraries, what the
# image already has, and what that path never imports (wandb: imported only when enabled; pillow
# and einops: multimodal and Flux models only). About 14 MB in all. torchtitan 0.2.2's
# Requires-Dist (torchdata, datasets, tokenizers, tomli, fsspec, tyro, tensorboard, einops, pillow)
# resolves to the same set: its `datasets` is unpinned (>=2.21), so it takes 0.3.0's 4.7.0 with that
# one's dill / multiprocess; tomli only where python < 3.11 (it reads tomllib first); einops and
# pillow again only in its Flux and VLM code, never on the Llama 3 / DeepSeek-V3 training path.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/.whl/" >>.git/info/exclude; }
download() {  # download DIR SPEC...: wheels only, for the GPU machine's python, never their dependencies
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$@"
}
download .whl "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "torchao==0.18.0"
rm -rf .whl/torchtitan
download .whl/torchtitan "torchtitan==0.3.0" \
    "spmd_types==0.2.3" "torch_checkpointing==0.1.0" "torchdata==0.11.0" \
    "tyro==1.0.17" "docstring_parser==0.18.0" "typeguard==4.6.1" "typing_extensions==4.16.0" \
    "datasets==4.7.0" "dill==0.4.0" "multiprocess==0.70.18" \
    "huggingface_hub==1.33.0" "hf-xet==1.8.0" "httpx==0.28.1" "httpcore==1.0.9" "h11==0.16.0" "anyio==4.16.0" \
    "click==8.5.1" \
    "tokenizers==0.23.3" "safetensors==0.8.0" \
    "tensorboard==2.21.0" "tensorboard-data-server==0.7.2" "protobuf==7.36.2" "absl-py==2.5.1" \
    "markdown==3.11.3" "werkzeug==3.1.9" "markupsafe==3.0.4"
rm -rf .whl/torchtitan-0.2
mkdir -p .whl/torchtitan-0.2
download .whl/torchtitan-0.2 "torchtitan==0.2.2"
# the rest of 0.2.2's set is the 0.3.0 folder's wheels, less the two only 0.3.0 needs
find .whl/torchtitan -maxdepth 1 -name '*.whl' ! -name 'torchtitan-*' ! -name 'spmd_types-*' \
    ! -name 'torch_checkpointing-*' -exec cp {} .whl/torchtitan-0.2/ \;
rm -rf .whl/transformers
download .whl/transformers "transformers==5.24.0" "regex==2026.11.19" "tokenizers==0.23.3" "safetensors==0.8.0" \
    "huggingface_hub==1.33.0" "hf-xet==1.8.0" "httpx==0.28.1" "httpcore==1.0.9" "h11==0.16.0" "anyio==4.16.0" \
    "click==8.5.1"
TOKENIZER=${PLAIT_TT_TOKENIZER:-../shared/bench/torchtitan-tokenizer}
if [ -d "$TOKENIZER" ]; then
    rm -rf .whl/torchtitan-tokenizer && cp -r "$TOKENIZER" .whl/torchtitan-tokenizer && chmod -R u+w .whl/torchtitan-tokenizer
else
    echo "gpu/wheels.sh: no torchtitan tokenizer at $TOKENIZER: the lease's torchtitan runs will fail" >&2
fi
ls .whl .whl/torchtitan .whl/torchtitan-0.2 .whl/transformers
du -sh .whl
