#!/usr/bin/env bash
# The wheels the GPU machines' python lacks for plait-train, into .whl (git-ignored): run here, where
# PyPI is reachable, before a lease; gpu/lease.sh installs them there (--no-deps, --no-index).
# The image has pyarrow, pandas, fsspec, huggingface-hub, xxhash, tqdm, pyyaml: `datasets` needs
# only these two more.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"
ls .whl
