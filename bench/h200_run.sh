#!/usr/bin/env bash
# The GPU measurements and checks BENCHMARKS.md reports, in one call on one H200 (about 8 minutes of
# device time): the kernel benchmark (every format), the engine benchmark, the tile and split sweep,
# then the CUDA-graph and engine tests on the GPU (about 3 minutes). Measurements come first, so a call
# cut short still brings numbers back. Results go to $OUT (default bench/results); each step runs even
# if an earlier one failed, and the exit code says whether any did.
#
#   OUT=/some/dir bash bench/h200_run.sh
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
status=0
run() {
    echo "== $*"
    "$@" || { echo "== failed ($?): $*"; status=1; }
}
run python bench/kernels.py --out "$OUT/kernels"
run python bench/engine_gpu.py --out "$OUT"
run python bench/kernels.py --formats "off;q8;q4;turboquant" --sweep --skip prefill,write --out "$OUT/sweep"
run python -m pytest -q -x tests/triton/test_triton_cuda_graph.py tests/test_engine_gpu.py
exit $status
