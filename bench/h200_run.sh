#!/usr/bin/env bash
# The GPU checks and measurements BENCHMARKS.md reports, in one call on one H200 (about 5 minutes of
# device time): the CUDA-graph and engine tests on the GPU, then the kernel benchmark (with the tile
# sweep) and the engine benchmark. Results go to $OUT (default bench/results); each step runs even if
# an earlier one failed, and the exit code says whether any did.
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
run python -m pytest -q -x tests/triton/test_triton_cuda_graph.py tests/test_engine_gpu.py
run python bench/kernels.py --formats "off;q8;q4;turboquant" --sweep --out "$OUT/kernels"
run python bench/engine_gpu.py --out "$OUT"
exit $status
