#!/usr/bin/env bash
# The GPU tests (marker needs_cuda) on the lent GPU machine, after `. .ci/device_env.sh`.
# Its image lacks moto, s3fs, zstandard and ray, so the files that need them are left out.
# The fault groups run one after another: their /dev/shm leak checks would see another
# group's live buffers.
set -uo pipefail
out=${OUT:-/tmp}
skip=(--ignore=tests/jobs/test_remote_inputs.py --ignore=tests/jobs/test_remote_masks.py
      --ignore=tests/jobs/test_remote_outputs.py --ignore=tests/faults/test_faults_remote_outputs.py
      --ignore=tests/scaleout/test_ray_cluster.py --ignore=tests/scaleout/test_build_index_ray.py
      --ignore=tests/index/test_cache.py
      --ignore=tests/sources/test_remote.py)
rc=0
python3 -m pytest -q -p no:cacheprovider -m needs_cuda "${skip[@]}" --ignore=tests/faults "$@" 2>&1 | tee "$out/gpu_rest.log" || rc=1
python3 -m pytest -q -p no:cacheprovider -m needs_cuda tests/faults/test_faults_build_index.py "$@" 2>&1 | tee "$out/gpu_faults_build.log" || rc=1
python3 -m pytest -q -p no:cacheprovider -m needs_cuda tests/faults/test_faults_segment.py "$@" 2>&1 | tee "$out/gpu_faults_segment.log" || rc=1
exit $rc
