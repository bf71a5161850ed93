#!/usr/bin/env bash
# The GPU measurements and checks BENCHMARKS.md reports, on one H200, in calls of under ten minutes each
# (a call's limit), measurements first so that a call cut short still brings numbers back. Results go to $OUT
# (default bench/results); each step has its own time limit and runs even if an earlier one failed; the exit
# code says whether any did.
# More than 8 files in an $OUT outside the repository (a device call's, which brings back 8) are packed into
# $OUT/results.tar.gz at the end.
#
#   OUT=/some/dir bash bench/h200_run.sh kernels   # the write GPU tests, kernel tables (plain and with a window of 128;
#                                                  # prefill also through the fused kernels)
#   OUT=/some/dir bash bench/h200_run.sh tests     # the decode, window and CUDA graph GPU tests (long: they compile)
#   OUT=/some/dir bash bench/h200_run.sh engine    # engine decode, same-memory (admission headroom on and off), tiers
#   OUT=/some/dir bash bench/h200_run.sh memory    # same-memory timelines: default admission; no headroom, recompute / swap
#   OUT=/some/dir bash bench/h200_run.sh prefill   # the Gluon prefill kernels' GPU tests, the prefill table, the probe
#   OUT=/some/dir bash bench/h200_run.sh gluon-tests  # the Gluon decode kernels' GPU tests
#   OUT=/some/dir bash bench/h200_run.sh gluon     # each Gluon decode kernel timed beside the default decode
#   OUT=/some/dir bash bench/h200_run.sh gluon-window   # decode with a window: as served, then all through Gluon
#   OUT=/some/dir bash bench/h200_run.sh longest-first  # decode programs launched longest sequence first: the GPU
#                                                  # tests, ragged batches by split count (q4, TurboQuant)
#   OUT=/some/dir bash bench/h200_run.sh longest-first-engine  # the same-memory run in grid order, then longest first
#   OUT=/some/dir bash bench/h200_run.sh buckets   # the same-memory run with the CUDA graph buckets, then the old ones
#   OUT=/some/dir bash bench/h200_run.sh ragged-engine  # the same-memory run with lengths spread +-50%, both orders
#   OUT=/some/dir bash bench/h200_run.sh step-kernels  # an engine prefill step and decode step by kernel
#   OUT=/some/dir bash bench/h200_run.sh prefill-gaps  # where the GPU waits in a prefill step; same-memory run
#   OUT=/some/dir bash bench/h200_run.sh async-memory  # same-memory run, asynchronous scheduling on and off
#   OUT=/some/dir bash bench/h200_run.sh off-splits  # kernel table, the dense decode's split counts, same-memory run
#   OUT=/some/dir bash bench/h200_run.sh memory-kernels  # the same-memory run's GPU time by kernel (torch.profiler)
#   OUT=/some/dir bash bench/h200_run.sh engine-shapes  # decode steps by kernel and the decode kernels' split counts at
#                                                  # the same-memory run's batches (1,536 tokens)
#   OUT=/some/dir bash bench/h200_run.sh split-counts  # K q4_0 / V q4_0 at the split counts 8, 12 and 16 programs a
#                                                  # multiprocessor give (the kernel table's shapes, batch 100)
#   OUT=/some/dir bash bench/h200_run.sh offsets32  # every Gluon decode kernel with page offsets in 32 bits beside 64
#                                                  # (decode_gluon.OFFSETS32), then their GPU test
#   OUT=/some/dir bash bench/h200_run.sh copies-only  # TurboQuant's decode beside its copies-only probe (the reads'
#                                                  # bound, at the table's shapes and the same-memory run's batch)
#   OUT=/some/dir bash bench/h200_run.sh longest-first-probes  # ragged batches for off, q4 at equal lengths
#   OUT=/some/dir bash bench/h200_run.sh lean-pick  # the lean options served (TurboQuant, q4, q6) against the kernels
#                                                  # before them, at every probe shape
#   OUT=/some/dir bash bench/h200_run.sh h200-first  # an H200's first call: served, then TurboQuant's bounds probed
#   OUT=/some/dir PYTEST_WORKERS=16 bash bench/h200_run.sh skew  # TQ_SKEW, Q4_SKEW: GPU tests, probes, same-memory
#   OUT=/some/dir bash bench/h200_run.sh lean-defaults  # the same-memory run, the lean defaults off and on
#   OUT=/some/dir bash bench/h200_run.sh ncu       # Nsight Compute on the Gluon decode kernels at (64, 8192): stalls
#   OUT=/some/dir bash bench/h200_run.sh ncu-off   # Nsight Compute: the dense decode beside a kernel that only reads
#                                                  # its pages (bench/page_read_probe.py), at (32, 4096)
#   OUT=/some/dir bash bench/h200_run.sh ncu-work  # Nsight Compute: TurboQuant's decode beside its work-only probe
#                                                  # (NCU_SHAPE, default 100x1536, 2 splits): stalls, pipes
#   OUT=/some/dir bash bench/h200_run.sh tail-rule  # same-memory q4 with the longest-first second-wave guard and without
#   OUT=/some/dir bash bench/h200_run.sh budgets   # the same-memory run at step token budgets 16384, 2048, 512
#   OUT=/some/dir bash bench/h200_run.sh mixed-graphs  # same-memory run with mixed steps in CUDA graphs (budget 256),
#                                                  # their GPU tests, the run as served (SERVED=0: not)
#   OUT=/some/dir bash bench/h200_run.sh eager-steps  # eager decode and mixed steps (no CUDA graph) timed and traced
#   OUT=/some/dir bash bench/h200_run.sh h200-cap96  # TurboQuant, 3 splits at 96 registers beside 2 at 128; work alone
#   OUT=/some/dir bash bench/h200_run.sh off-ids   # the dense decode with block ids a step ahead beside the served one
#                                                  # (`decode_gluon.DENSE_IDS_AHEAD`), twice, then its GPU test
#   OUT=/some/dir bash bench/h200_run.sh off-inner  # the dense decode with its splits inside a program (no reduce
#                                                  # kernel) beside the served one, twice, then its GPU test
#   OUT=/some/dir bash bench/h200_run.sh off-served  # the dense decode laid out by dense_plan (served): GPU tests,
#                                                  # table row, probe beside the splits across programs
#   OUT=/some/dir bash bench/h200_run.sh h200-inner  # on an H200: the served decode table and same-memory run, then
#                                                  # `off`'s with the splits across programs (DENSE_INNER False)
#   OUT=/some/dir bash bench/h200_run.sh off-layouts  # the dense decode's layouts where `off` is still over SDPA
#   OUT=/some/dir bash bench/h200_run.sh tq-lean   # TurboQuant's decode with half-register scale columns and codebook
#                                                  # tables in registers beside the served one (errors and times)
#   OUT=/some/dir bash bench/h200_run.sh lean-engine  # the same-memory run, TurboQuant with TQ_ROWS, TQ_TABLES,
#                                                  # OFFSETS32 and LANE_SUMS off / on, q4 with Q4_OFFSET_KEYS,
#                                                  # OFFSETS32 and LANE_SUMS off / on, alternating
#   OUT=/some/dir bash bench/h200_run.sh served    # issue 10's decode table and the same-memory run alone
#   OUT=/some/dir bash bench/h200_run.sh h200-lean  # on an H200: the served table and same-memory run, then the lean
#                                                  # TurboQuant variants and three splits at 96 registers
#   OUT=/some/dir bash bench/h200_run.sh write-caps  # TurboQuant's prefill writes under register caps: alone, in a
#                                                  # prefill step, and the same-memory run without and with one
#   OUT=/some/dir PYTEST_WORKERS=16 bash bench/h200_run.sh gpu-suite  # every kernel test on the GPU, each result
#                                                  # named as it ends (carry .venv-gpuwheels); gpu-engine: the
#                                                  # engine's, tiers' and tensor-parallel GPU tests the same way
#   OUT=/some/dir bash bench/h200_run.sh h200-pending  # on an H200, what issue 10's open targets wait for, in one call
#                                                  # (~9 min): the kernel table, the same-memory run, off-ids, h200-cap96
#   OUT=/some/dir bash bench/h200_run.sh ncu-splits  # Nsight Compute: TurboQuant's decode at 2 and 3 splits, its probes
#                                                  # at 3 (NCU_SHAPE, default 100x1536): why 3 splits run slower on an H100
#   OUT=/some/dir bash bench/h200_run.sh ncu-source  # stall reasons and wasted shared / L2 traffic per SASS
#                                                    # instruction (bench/ncu_summary.py), NCU_FORMATS="q4 q6 ...",
#                                                    # NCU_SHAPE=100x1536 (batch x context; default 64x8192)
#
# PYTEST_WORKERS=8 runs the GPU tests on 8 processes (they are bound by compiling kernels) when pytest-xdist is
# there: `make gpu-wheels` here, then carry .venv-gpuwheels; it is installed from those wheels.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
status=0
workers=()
if [ -n "${PYTEST_WORKERS:-}" ]; then
    [ -d .venv-gpuwheels ] && python -m pip install -q --no-deps --no-index .venv-gpuwheels/*.whl
    if python -c "import xdist" 2>/dev/null; then workers=(-n "$PYTEST_WORKERS"); else echo "== no pytest-xdist: one process"; fi
fi
run() {  # run LIMIT_SECONDS COMMAND...
    local limit=$1; shift
    local start=$(date +%s)
    echo "== $* (limit ${limit}s)"
    timeout "$limit" "$@" || { echo "== failed ($?): $*"; status=1; }
    echo "== $(( $(date +%s) - start ))s"
}
ncu_decode() {  # ncu_decode FORMAT NCU_OPTIONS...: Nsight Compute on one decode call at batch 64 and 8,192 tokens
                # (NCU_SHAPE=100x1536: another batch x context)
    local fmt=$1; shift
    run 200 ncu --clock-control none --kernel-name regex:"decode_(q8|q4|tq|dense)_kernel" --launch-skip 2 \
        --launch-count 1 "$@" python bench/profile_decode.py --formats "$fmt" --shapes "${NCU_SHAPE:-64x8192}" --plain \
        ${NCU_PROBE:+--probe "$NCU_PROBE" --probe-splits "${NCU_PROBE_SPLITS:-2}"}
}
off_ids_probe() {  # off_ids_probe LIMIT_SECONDS: the dense decode with block ids a step ahead (DENSE_IDS_AHEAD)
                  # beside the served kernel before and after it, at the served split counts (bench/gluon_probe.py)
    run "$1" env FORMAT=off SPLITS='{"1":[128],"32":[4],"64":[2],"128":[1]}' \
        VARIANTS='{"ring2": {}, "ids": {"ids_ahead": true}, "ring2b": {}}' OUT="$OUT" python bench/gluon_probe.py
}
step_ahead_tests() {  # the GPU tests of the decodes with block ids a step ahead (`off`, TurboQuant)
    run 150 python -m pytest -q -rf "${workers[@]}" tests/triton/test_decode_gluon.py -k "step_ahead"
}
ncu_reports() {  # ncu_reports NAME [TOP]: $OUT/NAME.ncu-rep's details as NAME.txt; with TOP, also its SASS as
                 # NAME_sass.csv and the TOP instructions of most stall samples (bench/ncu_summary.py)
    local name=$1 top=${2:-}
    ncu --import "$OUT/$name.ncu-rep" --page details --print-details all > "$OUT/$name.txt" 2>&1
    if [ -n "$top" ]; then
        ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv" 2>&1
        python bench/ncu_summary.py "$OUT/${name}_sass.csv" --top "$top"
    fi
}
# issue 10's same-memory run (every format's pages get 2 GiB; 256 requests of 1,024 + 1,024 tokens) and its table's
# formats
SAME_MEMORY=(bench/engine_gpu.py --same-memory 2 --requests 256 --prompt-tokens 1024 --new-tokens 1024)
TABLE_FORMATS="off;q8;q6;q4;turboquant;turboquant:k=q4_0,v=q4_0"
# every lean option of the TurboQuant and the q4 decodes (prepared, off until timed): as a probe variant's options
# (JSON members) and as the decode_gluon settings `with_setting` turns on
TQ_LEAN='"rows": true, "offsets32": true, "tables": true, "lane_sums": true'
Q4_LEAN='"offset_keys": true, "offsets32": true, "lane_sums": true'
# (the settings: those still off; LANE_SUMS and Q4_OFFSET_KEYS are served since 2026-12-07)
TQ_LEAN_SETTINGS=decode_gluon.TQ_ROWS,decode_gluon.TQ_TABLES,decode_gluon.OFFSETS32
Q4_LEAN_SETTINGS=decode_gluon.OFFSETS32
served_table_and_memory() {  # the decode table as served and the same-memory run (off, TurboQuant, q4), summarised
    run 170 python bench/kernel_bench.py --formats "$TABLE_FORMATS" --skip prefill,write --out "$OUT/kernels_served"
    run 150 python "${SAME_MEMORY[@]}" --formats off turboquant q4 --out "$OUT/memory"
    python bench/engine_steps.py "$OUT/memory/engine_memory.json"
}
with_setting() {  # with_setting MODULE.NAME[,MODULE.NAME...] VALUE LIMIT_SECONDS SCRIPT ARGS...: a bench script with
                 # each named pagedkv.ops.triton module's NAME set to VALUE (a Python expression)
    local setting=$1 value=$2 limit=$3 script=$4; shift 4
    run "$limit" python -c "import importlib, runpy, sys
for named in '$setting'.split(','):
    module, name = named.rsplit('.', 1); setattr(importlib.import_module('pagedkv.ops.triton.' + module), name, $value)
sys.path.insert(0, 'bench'); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" "$script" "$@"
}
with_dense_inner() {  # with_dense_inner True|False LIMIT_SECONDS SCRIPT ARGS...: decode_gluon.DENSE_INNER set (True,
                      # served since session 42: the dense plan; False: the splits across programs it replaced)
    with_setting decode_gluon.DENSE_INNER "$@"
}
with_write_cap() {  # with_write_cap None|N LIMIT_SECONDS SCRIPT ARGS...: kv_write.TQ_MAX_REGISTERS set (None: no cap,
                    # as served)
    with_setting kv_write.TQ_MAX_REGISTERS "$@"
}
settings_ab() {  # settings_ab MODULE.NAME[,...] LABEL ROUND FORMAT...: the same-memory run of each FORMAT with the
                 # named settings False, then True (`with_setting`); results in $OUT/memory_FORMAT_LABEL_VALUE_ROUND
    local settings=$1 label=$2 round=$3; shift 3
    for format in "$@"; do
        for value in False True; do
            with_setting "$settings" "$value" 90 "${SAME_MEMORY[@]}" --formats "$format" \
                --out "$OUT/memory_${format}_${label}_${value}_$round"
        done
    done
}
# the shapes at which lean-pick times a decode beside the served one: the same-memory run's batches at 1,536
# tokens (TurboQuant ~100-112, q4 and q6 ~112-144) and the kernel table's shapes
PICK_SHAPES_TQ='[[100, 1536], [112, 1536], [64, 1536], [128, 2048], [64, 8192], [32, 4096], [1, 32768]]'
PICK_SHAPES_Q4='[[144, 1536], [112, 1536], [64, 1536], [128, 2048], [64, 8192], [32, 4096], [1, 32768]]'
tq_lean_probe() {  # tq_lean_probe LIMIT_SECONDS: TurboQuant's decode as served (twice; half-register scale columns,
                   # TQ_HALVES, since session 48; the softmax sums in the lanes, LANE_SUMS, since session 49: 532 loop
                   # instructions a 16-key step) beside its scale columns shifted out (as before 48) and its sums
                   # added across the lanes every step (`steps`, as before 49: 544), with the codebook's tables in
                   # registers (TQ_TABLES; uncapped `ht145`), with page offsets in 32 bits (OFFSETS32), with constant
                   # slot strides (TQ_ROWS), all of them (`best`: 481; in 32-key steps, `bestpairs`: 445 per 16 keys;
                   # capped at 96 registers, 524 with 5 stack loads a step, 20 programs a multiprocessor where 128
                   # (and 104 or 112) hold 16: three splits of batch 100 resident at once), and the probes: the copies
                   # alone (the reads' bound; and with a third ring stage, `copies3`, beside the kernel's, `s3`: an
                   # H200 needs ~1.4x an H100's bytes in flight for its bandwidth) and the work alone of the served, shifted, `steps`, tables (`best`'s
                   # work: it has no copies, so no rows or 32-bit offsets) and 96-register kernels
    run "$1" env FORMAT=turboquant NAME=lean SHAPES='[[100, 1536], [112, 1536], [64, 8192], [32, 4096]]' \
        SPLITS='{"100": [1, 2, 3], "112": [1, 2, 3], "64": [2, 4], "32": [4, 8]}' VARIANTS='{"lf": {"ordered": true},
        "shifted": {"ordered": true, "halves": false}, "ht": {"ordered": true, "tables": true},
        "ht145": {"ordered": true, "tables": true, "max_registers": 0},
        "o32": {"ordered": true, "offsets32": true}, "o32ht": {"ordered": true, "offsets32": true, "tables": true},
        "rows": {"ordered": true, "rows": true},
        "steps": {"ordered": true, "lane_sums": false},
        "best": {"ordered": true, '"$TQ_LEAN"'}, "bestpairs": {"ordered": true, "pairs": true, '"$TQ_LEAN"'},
        "best96": {"ordered": true, '"$TQ_LEAN"', "max_registers": 96,
        "splits": {"100": [2, 3], "112": [2, 3], "64": [4, 5], "32": [8, 10]}},
        "workbest96": {"ordered": true, "probe": "work", "tables": true, "lane_sums": true, "max_registers": 96,
        "splits": {"100": [2, 3], "112": [2, 3], "64": [4, 5], "32": [8, 10]}},
        "copies": {"ordered": true, "probe": "copies"}, "s3": {"ordered": true, "stages": 3},
        "copies3": {"ordered": true, "probe": "copies", "stages": 3},
        "work": {"ordered": true, "probe": "work"}, "workshifted": {"ordered": true, "probe": "work", "halves": false},
        "workht": {"ordered": true, "probe": "work", "tables": true},
        "worksteps": {"ordered": true, "probe": "work", "lane_sums": false},
        "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
}
q4_offset_probe() {  # q4_offset_probe LIMIT_SECONDS: q4's decode as served (twice; its keys over their offsets,
                     # Q4_OFFSET_KEYS, and the softmax sums in the lanes, LANE_SUMS, since session 49: 587 loop
                     # instructions a 32-key step) beside it as before (neither: 659, twice), with each alone, with
                     # 32-bit page offsets too (`best`: 564) and so capped at 96 registers (`best96`, 591 with no
                     # spills: 20 programs a multiprocessor, so two splits of batch 144 resident at once), at the
                     # same-memory run's batches (~144 at 1,536 tokens) and the table's shapes
    run "$1" env FORMAT=q4 NAME=offset_keys SHAPES='[[144, 1536], [112, 1536], [64, 8192], [32, 4096], [1, 32768]]' \
        VARIANTS='{"lf": {"ordered": true}, "before": {"ordered": true, "offset_keys": false, "lane_sums": false},
        "offset": {"ordered": true, "lane_sums": false}, "ls": {"ordered": true, "offset_keys": false},
        "best": {"ordered": true, '"$Q4_LEAN"'},
        "best96": {"ordered": true, '"$Q4_LEAN"', "max_registers": 96,
        "splits": {"144": [1, 2, 3], "112": [1, 2], "64": [2, 4], "32": [4, 8], "1": [64, 128]}},
        "lf2": {"ordered": true}, "before2": {"ordered": true, "offset_keys": false, "lane_sums": false}}' OUT="$OUT" \
        python bench/gluon_probe.py
}
STALL_RATIOS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"   # stall cycles an instruction
case "${1:-kernels}" in
kernels)
    run 120 python -m pytest -q -rf tests/triton/test_triton_write.py -k "turboquant or q4"
    run 300 python bench/kernel_bench.py --formats "$TABLE_FORMATS" --recent-tokens 128 \
        --skip write --fused-prefill --out "$OUT/kernels"
    ;;
tests)
    run 560 python -m pytest -q -rf "${workers[@]}" tests/triton/test_triton_decode_window.py tests/test_recent_window.py \
        tests/triton/test_triton_cuda_graph.py tests/triton/test_triton_decode.py tests/test_devices.py
    ;;
engine)
    run 200 python bench/engine_gpu.py --formats off q8 q4 turboquant --batches 16 64 --context 8192 --requests 32 \
        --skip-generate-batch --out "$OUT"
    run 280 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --admission-lookahead-tokens 0 640 1024 --out "$OUT"
    run 90 python bench/tiers.py --model llama8b --device cuda --prefix-tokens 2048 8192 32768 --out "$OUT/h200"
    ;;
memory)   # the same-memory run with its timelines: the default admission, then no headroom with preemption by swap
    run 200 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --out "$OUT/memory_default"
    run 350 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --admission-lookahead-tokens 0 --preemption recompute swap --out "$OUT/memory_swap"
    ;;
prefill)   # the Gluon prefill kernels against the reference, then timed: every format, and beside the other kernels
    run 300 python -m pytest -q -rf "${workers[@]}" tests/triton/test_prefill_gluon.py tests/triton/test_dense_prefill.py \
        tests/triton/test_triton_cuda_graph.py
    run 150 python bench/kernel_bench.py --formats "$TABLE_FORMATS" --skip decode,write \
        --out "$OUT/kernels_prefill"
    run 120 python bench/prefill_probe.py --out "$OUT/prefill_probe"
    ;;
gluon-tests)   # the Gluon decode kernels against the reference (about 90 kernel variants to compile)
    run 560 python -m pytest -q -rf "${workers[@]}" tests/triton/test_decode_gluon.py
    ;;
gluon-window)   # decode with a dense recent window of 128: as served (WINDOW_KERNELS), then every format's Gluon kernel
    run 200 python bench/kernel_bench.py --formats "q8;q6;q4;turboquant" --recent-tokens 128 --skip prefill,write \
        --out "$OUT/kernels_window"
    run 200 python bench/kernel_bench.py --formats "q8;q6;q4;turboquant" --recent-tokens 128 --skip prefill,write \
        --gluon-window --out "$OUT/kernels_gluon_window"
    ;;
gluon)   # each Gluon decode kernel beside the default decode, 16 and 32 keys a step
    run 130 env FORMAT=turboquant VARIANTS='{"keys16": {"pairs": false}, "keys32": {"pairs": true}}' python bench/gluon_probe.py
    run 110 env FORMAT=turboquant:k=q4_0,v=q4_0 VARIANTS='{"keys16": {"pairs": false}, "keys32": {"pairs": true}}' \
        python bench/gluon_probe.py
    run 100 env FORMAT=q4 VARIANTS='{"keys16": {"pairs": false}, "keys32": {"pairs": true}}' python bench/gluon_probe.py
    run 100 env FORMAT=q6 VARIANTS='{"keys16": {"pairs": false}, "keys32": {"pairs": true}}' python bench/gluon_probe.py
    run 100 env FORMAT=off VARIANTS='{"ring2": {}}' python bench/gluon_probe.py
    ;;
longest-first)   # `metadata.LONGEST_FIRST`: the kernels in any token order, then ragged batches (lengths over the top
                 # half of the context) in grid order and longest first at 1-4 splits, q4 and TurboQuant
    run 240 python -m pytest -q -rf "${workers[@]}" tests/triton/test_decode_gluon.py tests/triton/test_triton_decode.py \
        -k "any_token_order"
    for fmt in q4 turboquant; do
        run 150 env FORMAT=$fmt SHAPES='[[128, 2048], [96, 2048], [64, 8192]]' SPREAD=0.5 \
            SPLITS='{"128": [1, 2, 3, 4], "96": [1, 2, 3, 4], "64": [2, 3, 4]}' \
            VARIANTS='{"grid": {}, "longest_first": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    done
    ;;
longest-first-engine)   # the same-memory run in grid order (no step should stand out: the compile fixed in
                        # session 28), then longest first; the slowest steps of each
    run 240 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --launch-order grid --out "$OUT/memory_grid_order"
    run 240 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --launch-order longest-first --out "$OUT/memory_longest_first"
    run 30 python bench/engine_steps.py "$OUT/memory_grid_order/engine_memory.json" \
        "$OUT/memory_longest_first/engine_memory.json"
    ;;
buckets)   # the same-memory run with the engine's CUDA graph buckets (every 8 up to 256), then the ones before
           # (1-32 by 8, 48, 64, 96, 128, 192, 256), and the steps of each; MEMORY_OPTIONS: more engine_gpu.py options
    for buckets in fine coarse; do
        sizes=()
        [ "$buckets" = coarse ] && sizes=(--graph-batch-sizes 1 2 4 8 16 24 32 48 64 96 128 192 256)
        run 260 python "${SAME_MEMORY[@]}" \
            --formats off turboquant q4 ${MEMORY_OPTIONS:-} "${sizes[@]}" --out "$OUT/memory_${buckets}_buckets"
    done
    run 30 python bench/engine_steps.py "$OUT/memory_fine_buckets/engine_memory.json" \
        "$OUT/memory_coarse_buckets/engine_memory.json"
    ;;
ragged-engine)   # the same-memory run with lengths spread +-50% (ragged batches, as a server's), in grid order
                 # and longest first
    for order in grid longest-first; do
        run 200 python "${SAME_MEMORY[@]}" \
            --length-spread 0.5 --formats off q4 turboquant --launch-order $order --out "$OUT/memory_ragged_${order/-/_}"
    done
    ;;
step-kernels)   # by kernel (and the kernels' total beside the step's wall time), compiled layers with every
                # dimension symbolic and with automatic dynamic shapes (the default): a same-memory prefill step
                # (16 prompts of 1,024 tokens), and a decode step at batch 128
    for dyn in true auto; do
        run 150 python bench/engine_profile.py --formats q4 --requests 16 --prompt-tokens 1024 --kernels --top 25 \
            --compile-dynamic $dyn
        run 150 python bench/engine_profile.py --formats q4 --requests 128 --prompt-tokens 1536 \
            --max-num-batched-tokens 16384 --kernels --top 20 --compile-dynamic $dyn
    done
    ;;
prefill-gaps)   # where the GPU waits in a same-memory prefill step (16 prompts of 1,024 tokens, q4): kernels and wall,
                # a chrome trace with the host's Python stack read by bench/trace_gaps.py, a step under CUDA sync
                # debugging; then the same-memory run with the defaults
    run 200 python bench/engine_profile.py --formats q4 turboquant --requests 16 --prompt-tokens 1024 --kernels --top 12 \
        --trace "$OUT"
    run 240 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --out "$OUT/memory_defaults"
    ;;
off-splits)   # the dense decode's split counts with four KV heads a program (2-3 resident a multiprocessor): the
              # kernel table in the served order, the split counts side by side (longest first), the same-memory run
    run 200 python bench/kernel_bench.py --formats "$TABLE_FORMATS" \
        --skip prefill,write --out "$OUT/kernels"
    run 120 env FORMAT=off SPLITS='{"1": [64, 96, 128, 192], "32": [4, 5, 6], "64": [2, 3], "128": [2, 3]}' \
        VARIANTS='{"longest_first": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    run 240 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --out "$OUT/memory"
    run 30 python bench/engine_steps.py "$OUT/memory/engine_memory.json"
    ;;
engine-shapes)   # the decode kernels at the batches and lengths of the same-memory run's decode steps: one eager
                 # decode step by kernel per format at its batch there, then each kernel over split counts (longest
                 # first; session 33 ran the probes with the "lf" variant only)
    for x in off:40 q4:144 turboquant:100; do
        run 130 python bench/engine_profile.py --formats "${x%%:*}" --requests "${x##*:}" --prompt-tokens 1536 \
            --max-num-batched-tokens 16384 --kernels --top 22
    done
    # longest first as served, and with a third ring stage (ENGINE_SHAPE_VARIANTS replaces the pair)
    variants=${ENGINE_SHAPE_VARIANTS:-'{"lf": {"ordered": true}, "lf3": {"ordered": true, "stages": 3}}'}
    run 200 env FORMAT=turboquant SHAPES='[[100, 1536], [64, 1536], [128, 2048]]' \
        SPLITS='{"100": [1, 2, 3, 4, 6], "64": [2, 3, 4, 6], "128": [1, 2, 3, 4]}' \
        VARIANTS="$variants" OUT="$OUT" python bench/gluon_probe.py
    run 160 env FORMAT=q4 SHAPES='[[144, 1536], [100, 1536]]' SPLITS='{"144": [1, 2, 3, 4], "100": [1, 2, 3, 4]}' \
        VARIANTS="$variants" OUT="$OUT" python bench/gluon_probe.py
    run 80 env FORMAT=off SHAPES='[[40, 1536]]' SPLITS='{"40": [2, 3, 4, 6, 8]}' \
        VARIANTS='{"lf": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    ;;
split-counts)   # which programs per multiprocessor TQ_TUNING should give K q4_0 / V q4_0 (12; 16 until session
                # 37; its 162 registers fit 12): the table's shapes and the same-memory run's batch at the split counts
                # 8, 12 and 16 give, longest first (on an H100, session 35: half the served splits 8-15% faster)
    run 110 env FORMAT="turboquant:k=q4_0,v=q4_0" SHAPES='[[64, 8192], [32, 4096], [100, 1536], [128, 2048]]' \
        SPLITS='{"64": [2, 3, 4], "32": [4, 6, 8], "100": [2, 3], "128": [2, 3]}' \
        VARIANTS='{"lf": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    ;;
offsets32)   # page offsets in 32 bits (`decode_gluon.offsets_in_32_bits`: 3-5% fewer loop instructions, compiled for
             # sm_90) beside the int64 ones, every Gluon decode kernel at the table's shapes and the same-memory run's
             # TurboQuant batch, longest first, at the split counts the rules give; each variant's error printed
    for fmt in turboquant q4 "turboquant:k=q4_0,v=q4_0" q8 q6 off; do
        run 100 env FORMAT="$fmt" SHAPES='[[64, 8192], [32, 4096], [1, 32768], [128, 2048], [100, 1536]]' \
            SPLITS='{"64": [2, 4], "32": [4, 8], "1": [128], "128": [2], "100": [2, 3]}' \
            VARIANTS='{"lf": {"ordered": true}, "lf32": {"ordered": true, "offsets32": true}}' OUT="$OUT" \
            python bench/gluon_probe.py
    done
    run 200 python -m pytest -q -rf "${workers[@]}" tests/triton/test_decode_gluon.py -k "offsets"
    ;;
copies-only)   # TurboQuant's kernels beside their probes (`paged_attention_tq(probe=...)`, `decode_gluon.PROBES`:
               # "copies", the same programs, copies and waits without a step's work; "codes", without the scale rows;
               # "work", the work without the copies): whether the page reads or the work bound them
    run 150 env FORMAT=turboquant SHAPES='[[100, 1536], [64, 1536], [64, 8192], [32, 4096], [128, 2048], [1, 32768]]' \
        SPLITS='{"100": [2, 3], "64": [2, 4], "32": [4, 8], "128": [2], "1": [128]}' \
        VARIANTS='{"lf": {"ordered": true}, "copies": {"ordered": true, "probe": "copies"}, "codes": {"ordered": true,
        "probe": "codes"}, "work": {"ordered": true, "probe": "work"}}' OUT="$OUT" python bench/gluon_probe.py
    run 100 env FORMAT="turboquant:k=q4_0,v=q4_0" SHAPES='[[100, 1536], [64, 8192], [32, 4096]]' \
        SPLITS='{"100": [2, 3], "64": [2, 3], "32": [4, 6]}' \
        VARIANTS='{"lf": {"ordered": true}, "copies": {"ordered": true, "probe": "copies", "pairs": false},
        "work": {"ordered": true, "probe": "work", "pairs": false}}' \
        OUT="$OUT" python bench/gluon_probe.py
    ;;
memory-kernels)   # the same-memory run under torch.profiler: the GPU time of each kernel over the whole run (the
                  # profiler slows it: its tokens/s are not the run's; the calls say whether graph replays were seen)
    run 420 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --profile-kernels --out "$OUT/memory_kernels"
    ;;
async-memory)   # the same-memory run with asynchronous scheduling (the default) and without, side by side; then
                # the inductor kernels of the MLP's SiLU-times-up and residual adds, and the GPU tests of the order
    run 200 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --out "$OUT/memory_async"
    run 200 python "${SAME_MEMORY[@]}" \
        --formats off turboquant q4 --no-async-scheduling --out "$OUT/memory_sync"
    for f in memory_async memory_sync; do python bench/engine_steps.py "$OUT/$f/engine_memory.json"; done
    mkdir -p "$OUT/inductor"
    for f in $(grep -rl --include=*.py -E "def triton_poi_fused_.*(mul_silu|_add_[0-9])" /tmp/torchinductor_* 2>/dev/null | head -40); do
        cp "$f" "$OUT/inductor/" && echo "== $f" && grep -n -B3 -A1 -E "^def triton_poi_fused_.*(mul_silu|_add_[0-9])" "$f" | head -12
    done
    run 150 python -m pytest -q -rf "${workers[@]}" tests/test_longest_first.py tests/test_engine_cuda_graph.py \
        tests/test_engine_async.py
    run 170 python bench/kernel_bench.py --formats "$TABLE_FORMATS" \
        --skip prefill,write --out "$OUT/kernels_served_order"
    ;;
longest-first-probes)   # ragged batches for off, and q4 at equal lengths (what a second split costs there)
    run 150 env FORMAT=off SHAPES='[[128, 2048], [96, 2048], [64, 8192]]' SPREAD=0.5 \
        SPLITS='{"128": [1, 2, 3, 4], "96": [1, 2, 3, 4], "64": [2, 3, 4]}' \
        VARIANTS='{"grid": {}, "longest_first": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    run 100 env FORMAT=q4 SHAPES='[[128, 1536]]' SPLITS='{"128": [1, 2, 3]}' \
        VARIANTS='{"grid": {}, "longest_first": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    ;;
ncu)   # hardware counters of one decode call per format at batch 64 and 8,192 tokens (where the time stalls)
    for fmt in off q8 turboquant turboquant:k=q4_0,v=q4_0; do
        ncu_decode "$fmt" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --log-file "$OUT/ncu_${fmt//[:=,]/_}.txt"
    done
    ;;
ncu-off)   # the dense decode kernel beside a kernel that only reads the same pages (page_read_probe.py), at (32, 4096):
           # what the dense kernel does that keeps it 2-3% above the read bound (stalls, DRAM throughput, occupancy)
    sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
              --section SchedulerStats --section MemoryWorkloadAnalysis)
    run 200 ncu --clock-control none --kernel-name regex:"decode_dense_kernel" --launch-skip 2 --launch-count 1 \
        "${sections[@]}" --log-file "$OUT/ncu_off_decode_32x4096.txt" \
        python bench/profile_decode.py --formats off --shapes 32x4096 --plain
    run 200 ncu --clock-control none --kernel-name regex:"read_kernel" --launch-skip 2 --launch-count 1 \
        "${sections[@]}" --log-file "$OUT/ncu_off_read_32x4096.txt" \
        python bench/page_read_probe.py --shapes 32x4096 --stages 2 --out /tmp
    ;;
ncu-work)   # TurboQuant's decode beside its work-only probe (no copies, no waits) at the same-memory batch, 2 splits:
            # where the step's work stalls and which pipes it fills, per SASS instruction (NCU_SHAPE, default 100x1536)
    for probe in kernel work; do
        name="ncu_work_${probe}_${NCU_SHAPE:-100x1536}"
        NCU_SHAPE=${NCU_SHAPE:-100x1536} NCU_PROBE=${probe#kernel} NCU_PROBE_SPLITS=2 ncu_decode turboquant \
            --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
            --section InstructionStats --section Occupancy --metrics "$STALL_RATIOS" -f -o "$OUT/$name"
        ncu_reports "$name" 12
    done
    ;;
tail-rule)   # the same-memory run (q4, then off for the ratio) with longest-first split counts kept out of a short
             # second wave (`tuning.ORDERED_TAIL_WAVES`, session 38) and without (1.0), then the steps by batch size
    run 200 python "${SAME_MEMORY[@]}" \
        --formats q4 off --out "$OUT"
    cp "$OUT/engine_memory.json" "$OUT/engine_memory_tail_rule.json" 2>/dev/null
    run 120 python "${SAME_MEMORY[@]}" \
        --formats q4 --ordered-tail-waves 1.0 --out "$OUT"
    cp "$OUT/engine_memory.json" "$OUT/engine_memory_no_tail_rule.json" 2>/dev/null
    for f in tail_rule no_tail_rule; do python bench/engine_steps.py "$OUT/engine_memory_$f.json"; done
    ;;
budgets)   # the same-memory run at step token budgets (BUDGETS, default 16384 2048 512): whether prompts chunked small
           # enough to ride along decode steps (whose matrix products are bound by the weights' reads) pay for the
           # eager mixed steps they make
    budgets=${BUDGETS:-16384 2048 512}
    for b in $budgets; do
        run 200 python "${SAME_MEMORY[@]}" --formats ${FORMATS:-off turboquant q4} --max-num-batched-tokens "$b" \
            --out "$OUT/budget$b"
    done
    for b in $budgets; do python bench/engine_steps.py "$OUT/budget$b/engine_memory.json"; done
    ;;
mixed-graphs)   # mixed steps replayed from CUDA graphs (cuda_graph_mixed_tokens): the same-memory run with a step
                # budget of MIXED_TOKENS (default 256) and its graphs first, then their GPU tests, then the run as
                # served (budget 16,384) beside it unless SERVED=0 (short device time: session 42's ratios stand in)
    mixed=${MIXED_TOKENS:-256}
    run 240 python "${SAME_MEMORY[@]}" --formats ${FORMATS:-off turboquant q4} --max-num-batched-tokens "$mixed" \
        --cuda-graph-mixed-tokens "$mixed" --out "$OUT/mixed$mixed"
    python bench/engine_steps.py "$OUT/mixed$mixed/engine_memory.json"
    run 150 python -m pytest -q -rf -p no:cacheprovider tests/test_engine_gpu.py tests/triton/test_mixed_parts.py \
        -k "mixed"
    if [ "${SERVED:-1}" != 0 ]; then
        run 200 python "${SAME_MEMORY[@]}" --formats ${FORMATS:-off turboquant q4} --out "$OUT/served"
        python bench/engine_steps.py "$OUT/served/engine_memory.json"
    fi
    ;;
eager-steps)   # what a step that replays no CUDA graph costs (mixed steps: a prompt admitted beside the decodes):
               # eager decode and mixed steps at the same-memory batch timed without a profiler, compiled layers on
               # and off, then traced (host Python stacks, where the GPU waits: bench/trace_gaps.py)
    for layers in --compile-layers --no-compile-layers; do
        run 200 python bench/engine_profile.py --formats ${FORMATS:-turboquant off} --requests 100 --prompt-tokens 1024 \
            --plain-steps 8 --top 25 $layers
    done
    run 150 python bench/engine_profile.py --formats turboquant --requests 100 --prompt-tokens 1024 --top 25 \
        --trace "$OUT"
    ;;
h200-cap96)   # TurboQuant at three splits capped at 96 registers (all resident) beside the served two at 128, and the
              # work alone at each: whether the H200, where the work bounds the kernel, gains from the extra programs
    run 150 env FORMAT=turboquant SHAPES='[[100, 1536], [96, 1536], [112, 1536], [64, 8192], [32, 4096], [128, 2048]]' \
        SPLITS='{"100": [2, 3], "96": [2, 3], "112": [2, 3], "64": [2, 4], "32": [4, 8], "128": [2, 3]}' \
        VARIANTS='{"lf": {"ordered": true}, "cap96": {"ordered": true, "max_registers": 96}, "copies": {"ordered": true,
        "probe": "copies"}, "work": {"ordered": true, "probe": "work"}, "work96": {"ordered": true, "probe": "work",
        "max_registers": 96}}' OUT="$OUT" python bench/gluon_probe.py
    ;;
off-ids)   # the dense decode loading each copy's block id a step ahead (DENSE_IDS_AHEAD), beside the served kernel
           # before and after it, at the served split counts, twice (H100, session 39: 0.2-1.0% faster, (32, 4096) same)
    off_ids_probe 120
    off_ids_probe 120
    step_ahead_tests
    ;;
off-inner)   # the dense decode with its splits inside a program (`paged_attention_dense(inner=...)`: warps merge in
             # shared memory, no reduce kernel) beside the served one and its page kernel alone, twice (ROUNDS=n: n
             # times), after its GPU test
    run 200 python -m pytest -q -rf "${workers[@]}" tests/triton/test_decode_gluon.py -k "inside_a_program"
    for round in $(seq "${ROUNDS:-2}"); do
        run 150 env FORMAT=off NAME="inner$round" SHAPES='[[32, 4096], [64, 8192], [1, 32768], [128, 2048]]' \
            SPLITS='{"1": [128], "32": [4], "64": [2], "128": [2]}' VARIANTS='{"served": {"ordered": true},
            "pages": {"ordered": true, "probe": "pages"},
            "h2i4": {"ordered": true, "heads": 2, "inner": 4, "splits": {"1": [32], "32": [1], "64": [1], "128": [1]}},
            "h1i4": {"ordered": true, "heads": 1, "inner": 4, "splits": {"1": [32], "32": [1], "64": [1], "128": [1]}},
            "h4i2": {"ordered": true, "heads": 4, "inner": 2, "splits": {"1": [64], "32": [1, 2], "64": [1], "128": [1]}},
            "h2i2": {"ordered": true, "heads": 2, "inner": 2, "splits": {"1": [64], "32": [1, 2], "64": [1], "128": [1]}},
            "h1i2": {"ordered": true, "heads": 1, "inner": 2, "splits": {"1": [64], "32": [1, 2], "64": [1], "128": [1]}}}' \
            OUT="$OUT" python bench/gluon_probe.py
    done
    ;;
off-served)   # the dense decode laid out by `decode_gluon.dense_plan` (splits inside a program; DENSE_INNER, served
              # since session 42): its GPU tests, the kernel table's `off` row, and the probe beside the splits
              # across programs at the table's shapes and two of the same-memory run's batches
    run 200 python -m pytest -q -rf "${workers[@]}" tests/triton/test_decode_gluon.py tests/triton/test_triton_cuda_graph.py \
        -k "inside_a_program or off-off or replays"
    run 150 python bench/kernel_bench.py --formats off --skip prefill,write --out "$OUT/kernels_off_plan"
    run 120 env FORMAT=off NAME=plan SHAPES='[[32, 4096], [64, 8192], [1, 32768], [128, 2048], [40, 1536], [48, 1536]]' \
        SPLITS='{"1": [128], "32": [4], "64": [2], "128": [2], "40": [3], "48": [2]}' \
        VARIANTS='{"across": {"ordered": true}, "plan": {"ordered": true, "plan": true}}' OUT="$OUT" python bench/gluon_probe.py
    ;;
h200-inner)   # on an H200, issue 10's table and the dense plan beside what it replaced, in one call (~7 min): the
              # decode table and the same-memory run as served (the dense plan), then `off`'s table row and
              # same-memory run with the splits across programs (DENSE_INNER False)
    nvidia-smi --query-gpu=name --format=csv,noheader
    served_table_and_memory
    with_dense_inner False 60 bench/kernel_bench.py --formats off --skip prefill,write --out "$OUT/kernels_off_across"
    with_dense_inner False 90 "${SAME_MEMORY[@]}" --formats off --out "$OUT/memory_off_across"
    ;;
off-layouts)   # the dense decode's layouts at (32, 4096) and (64, 8192), where `off` is still over SDPA's time: the
               # plan beside three warps' rings, other heads x inner splits, and splits across on top
    run 150 env FORMAT=off NAME=layouts SHAPES='[[32, 4096], [64, 8192]]' SPLITS='{"32": [4], "64": [2]}' \
        VARIANTS='{"plan": {"ordered": true, "plan": true}, "plan3": {"ordered": true, "plan": true, "stages": 3},
        "h2i4": {"ordered": true, "heads": 2, "inner": 4, "splits": {"32": [1, 2], "64": [1, 2]}},
        "h1i4": {"ordered": true, "heads": 1, "inner": 4, "splits": {"32": [1, 2], "64": [1]}},
        "h4i2": {"ordered": true, "heads": 4, "inner": 2, "splits": {"32": [1, 2], "64": [1, 2]}},
        "h2i2": {"ordered": true, "heads": 2, "inner": 2, "splits": {"32": [2], "64": [1]}},
        "h2i2s3": {"ordered": true, "heads": 2, "inner": 2, "stages": 3, "splits": {"32": [2], "64": [1]}}}' \
        OUT="$OUT" python bench/gluon_probe.py
    ;;
write-caps)   # TurboQuant's prefill-sized writes under register caps (kv_write.TQ_MAX_REGISTERS: 90 registers hold
              # 22 one-warp programs an SM, 64 the block limit's 32): the write alone at each cap, a 16-prompt prefill
              # step by kernel, then the same-memory run without and with a cap of 64, twice
    for cap in None 72 64; do
        with_write_cap "$cap" 100 bench/kernel_bench.py --formats "turboquant;turboquant:k=q4_0,v=q4_0" \
            --skip decode,prefill --out "$OUT/write_cap_$cap"
    done
    for cap in None 64; do
        with_write_cap "$cap" 100 bench/engine_profile.py --formats turboquant --requests 16 --prompt-tokens 1024 \
            --kernels --top 6
    done
    for cap in None 64 None 64; do
        with_write_cap "$cap" 80 "${SAME_MEMORY[@]}" --formats turboquant --out "$OUT/memory_write_cap_$cap"
    done
    ;;
tq-lean)   # TurboQuant's lean decode variants beside the served kernel, with the copies-only and work-only probes
           # (what an H100, bound by the reads, hides; `tq_lean_probe`), q4's (`q4_offset_probe`), then TurboQuant at
           # the table's other shapes and K q4_0 / V q4_0 with its scale columns shifted and with TQ_LEAN
    nvidia-smi --query-gpu=name --format=csv,noheader
    tq_lean_probe 200
    q4_offset_probe 100
    run 120 env FORMAT=turboquant NAME=lean_table SHAPES='[[64, 1536], [128, 2048], [1, 32768]]' \
        SPLITS='{"64": [2, 4], "128": [1, 2], "1": [128]}' VARIANTS='{"lf": {"ordered": true},
        "shifted": {"ordered": true, "halves": false}, "ht": {"ordered": true, "tables": true},
        "o32ht": {"ordered": true, "offsets32": true, "tables": true},
        "best": {"ordered": true, '"$TQ_LEAN"'},
        "bestpairs": {"ordered": true, "pairs": true, '"$TQ_LEAN"'}}' OUT="$OUT" \
        python bench/gluon_probe.py
    run 120 env FORMAT="turboquant:k=q4_0,v=q4_0" NAME=lean44 SHAPES='[[100, 1536], [64, 8192], [32, 4096],
        [128, 2048], [1, 32768]]' VARIANTS='{"lf": {"ordered": true}, "shifted": {"ordered": true, "halves": false},
        "rows": {"ordered": true, "rows": true}, "o32rows": {"ordered": true, "rows": true, "offsets32": true},
        "best": {"ordered": true, '"$TQ_LEAN"'}, "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    ;;
lean-pick)  # the lean options served since session 49 (LANE_SUMS; q4's Q4_OFFSET_KEYS) against the kernels before
            # them and with 32-bit page offsets too, at every probe shape: TurboQuant as served, with its softmax
            # sums added across the lanes every step (`steps`) and with 32-bit offsets (`o32`); q4 and q6 as served,
            # as before (`before`) and with 32-bit offsets; each served kernel timed twice
    nvidia-smi --query-gpu=name --format=csv,noheader
    run 150 env FORMAT=turboquant NAME=lean_pick SHAPES="$PICK_SHAPES_TQ" VARIANTS='{"lf": {"ordered": true},
        "steps": {"ordered": true, "lane_sums": false}, "o32": {"ordered": true, "offsets32": true},
        "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    for format in q4 q6; do
        run 120 env FORMAT=$format NAME=lean_pick SHAPES="$PICK_SHAPES_Q4" VARIANTS='{"lf": {"ordered": true},
            "before": {"ordered": true, "offset_keys": false, "lane_sums": false},
            "o32": {"ordered": true, "offsets32": true}, "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    done
    ;;
skew)   # TQ_SKEW and Q4_SKEW (the TurboQuant and q4 loops software-pipelined: a step's scores and softmax beside the
        # value products of the step before; 549 / 603 loop instructions at 128 registers, a deeper ring): their GPU
        # tests, then TurboQuant as served, skewed, skewed with every lean option and with three stages, and the work
        # alone both ways, and q4 as served and skewed, at every probe shape, then the same-memory run for each without
        # and with it (~8 min)
    nvidia-smi --query-gpu=name --format=csv,noheader
    run 150 python -m pytest -q -rf "${workers[@]}" -p no:cacheprovider tests/triton/test_decode_gluon.py -k "skew"
    run 170 env FORMAT=turboquant NAME=skew SHAPES="$PICK_SHAPES_TQ" VARIANTS='{"lf": {"ordered": true},
        "skew": {"ordered": true, "skew": true}, "skewbest": {"ordered": true, '"$TQ_LEAN"', "skew": true},
        "skew3": {"ordered": true, "skew": true, "stages": 3},
        "work": {"ordered": true, "probe": "work"}, "workskew": {"ordered": true, "probe": "work", "skew": true},
        "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    run 120 env FORMAT=q4 NAME=skew SHAPES="$PICK_SHAPES_Q4" VARIANTS='{"lf": {"ordered": true},
        "skew": {"ordered": true, "skew": true}, "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    settings_ab decode_gluon.TQ_SKEW skew 1 turboquant
    settings_ab decode_gluon.Q4_SKEW skew 1 q4
    ;;
skew-short)   # `skew` for a call with ~4 min left: TurboQuant's probes at three shapes and q4's at the same-memory run's
              # batch, at their served split counts, then the GPU tests of the skewed kernels
    nvidia-smi --query-gpu=name --format=csv,noheader
    run 100 env FORMAT=turboquant NAME=skew_short SHAPES='[[100, 1536], [64, 8192], [32, 4096]]' \
        SPLITS='{"100": [2], "64": [2], "32": [4]}' VARIANTS='{"lf": {"ordered": true},
        "skew": {"ordered": true, "skew": true}, "work": {"ordered": true, "probe": "work"},
        "workskew": {"ordered": true, "probe": "work", "skew": true}, "lf2": {"ordered": true}}' OUT="$OUT" \
        python bench/gluon_probe.py
    run 60 env FORMAT=q4 NAME=skew_short SHAPES='[[144, 1536]]' SPLITS='{"144": [2]}' VARIANTS='{"lf": {"ordered":
        true}, "skew": {"ordered": true, "skew": true}, "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    run 120 python -m pytest -q -rf "${workers[@]}" -p no:cacheprovider tests/triton/test_decode_gluon.py \
        -k "skew and not tables and not lane_sums and not offsets32"
    ;;
h200-first)   # what an H200 lease should run first (~9 min): issue 10's decode table as served and the same-memory
              # run (`served`), then TurboQuant at the same-memory run's batches and the table's shapes: as served,
              # with every lean option, skewed (TQ_SKEW) with and without them, and the probes (the copies alone with
              # two and three stages, the work alone served and skewed): on an H200 they say whether its reads or its
              # work bound it at (100, 1536); then q4 served and skewed (Q4_SKEW) at its same-memory batches. The
              # skewed kernels' GPU tests: `skew-short` or `skew`
    nvidia-smi --query-gpu=name --format=csv,noheader
    served_table_and_memory
    run 170 env FORMAT=turboquant NAME=first SHAPES='[[100, 1536], [112, 1536], [64, 8192], [32, 4096]]' \
        SPLITS='{"100": [2], "112": [2, 3], "64": [2, 4], "32": [4]}' VARIANTS='{"lf": {"ordered": true},
        "best": {"ordered": true, '"$TQ_LEAN"'}, "skew": {"ordered": true, "skew": true},
        "skewbest": {"ordered": true, '"$TQ_LEAN"', "skew": true},
        "copies": {"ordered": true, "probe": "copies"}, "copies3": {"ordered": true, "probe": "copies", "stages": 3},
        "work": {"ordered": true, "probe": "work"}, "workskew": {"ordered": true, "probe": "work", "skew": true},
        "lf2": {"ordered": true}}' OUT="$OUT" python bench/gluon_probe.py
    run 60 env FORMAT=q4 NAME=first SHAPES='[[144, 1536], [112, 1536]]' SPLITS='{"144": [1, 2], "112": [1, 2]}' \
        VARIANTS='{"lf": {"ordered": true}, "skew": {"ordered": true, "skew": true}, "lf2": {"ordered": true}}' \
        OUT="$OUT" python bench/gluon_probe.py
    ;;
lean-defaults)  # the same-memory run for TurboQuant and q4 with LANE_SUMS and Q4_OFFSET_KEYS off (as served before
                # 2026-12-07) and on (as served now), alternating (ROUNDS=n: n times; default 1)
    nvidia-smi --query-gpu=name --format=csv,noheader
    for round in $(seq "${ROUNDS:-1}"); do
        settings_ab decode_gluon.LANE_SUMS,decode_gluon.Q4_OFFSET_KEYS lean "$round" turboquant q4
    done
    ;;
lean-engine)   # TurboQuant as served and with TQ_LEAN_SETTINGS on (481 loop instructions against 532), then q4
               # as served and with Q4_LEAN_SETTINGS on (564 against 587 a 32-key step): the same-memory run
               # alternating, twice (ROUNDS=n: n times); then the GPU tests of those variants (`variants_match`)
    nvidia-smi --query-gpu=name --format=csv,noheader
    for round in $(seq "${ROUNDS:-2}"); do
        settings_ab "$TQ_LEAN_SETTINGS" lean "$round" turboquant
        settings_ab "$Q4_LEAN_SETTINGS" lean "$round" q4
    done
    run 200 python -m pytest -q -rf "${workers[@]}" -p no:cacheprovider tests/triton/test_decode_gluon.py \
        -k variants_match
    ;;
served)   # issue 10's decode table as served and the same-memory run, nothing else (~5 min: what an H200 lease that
          # comes with little device time left should run)
    nvidia-smi --query-gpu=name --format=csv,noheader
    served_table_and_memory
    ;;
h200-lean)   # on an H200, in one call (~9 min): TurboQuant's lean variants and three splits capped at 96 registers at
             # the run's batches (tq-lean's first probe), q4 with its keys over their offsets, then issue 10's decode
             # table as served and the same-memory run (a call cut short by the device time left still brings the
             # probes back)
    nvidia-smi --query-gpu=name --format=csv,noheader
    tq_lean_probe 200
    q4_offset_probe 100
    served_table_and_memory
    ;;
gpu-suite|gpu-engine)   # gpu-suite: every kernel test on the GPU (tests/triton but test_sm90_compile.py, which
             # compiles for sm_90 on any machine), the window and device tests; gpu-engine: the engine's, tiers' and
             # tensor-parallel GPU tests (PYTEST_WORKERS processes). Each test's result as it ends goes to
             # $OUT/$1.txt (so a run cut at its limit still names its failures), then the failures; the tests
             # of the default model (marker `model`) are left out: its wheel is not carried
    if [ "$1" = gpu-suite ]; then
        files="tests/triton tests/test_recent_window.py tests/test_devices.py --ignore tests/triton/test_sm90_compile.py"
    else
        files="tests/test_engine_gpu.py tests/test_engine_async.py tests/test_engine_cuda_graph.py"
        files="$files tests/test_tiers_gpu.py tests/test_parallel_gpu.py"
    fi
    run 560 bash -c "python -m pytest -v -rf ${workers[*]} -p no:cacheprovider -m 'not model' $files \
        > '$OUT/$1.txt' 2>&1"
    grep -E "(FAILED|ERROR)( |$)" "$OUT/$1.txt" | sort | uniq | head -60
    tail -3 "$OUT/$1.txt"
    ;;
h200-pending)   # what sessions on H100s left for an H200, in one call: the decode table as served (issue 10's
                # kernel targets), the same-memory run (q4 2.5x with session 38's tail rule, TurboQuant 2.0x), `off`
                # with block ids a step ahead (DENSE_IDS_AHEAD), TurboQuant at 3 splits capped at 96 registers and
                # with its block ids a step ahead, then the GPU tests of the block ids a step ahead
    nvidia-smi --query-gpu=name --format=csv,noheader
    served_table_and_memory
    off_ids_probe 100
    run 120 env FORMAT=turboquant SHAPES='[[100, 1536], [96, 1536], [112, 1536], [64, 8192], [32, 4096]]' \
        SPLITS='{"100": [2, 3], "96": [2, 3], "112": [2, 3], "64": [2, 4], "32": [4, 8]}' \
        VARIANTS='{"lf": {"ordered": true}, "cap96": {"ordered": true, "max_registers": 96}, "ids": {"ordered": true,
        "ids_ahead": true}, "cap96ids": {"ordered": true, "max_registers": 96, "ids_ahead": true}}' OUT="$OUT" \
        python bench/gluon_probe.py
    step_ahead_tests
    ;;
ncu-splits)   # TurboQuant's decode at two and three splits (NCU_SHAPE, default 100x1536), and its copies-only and
              # work-only probes at three: memory, occupancy, stalls side by side
    for run in kernel:2 kernel:3 copies:3 work:3; do
        name="ncu_splits_${run/:/_}_${NCU_SHAPE:-100x1536}"
        NCU_SHAPE=${NCU_SHAPE:-100x1536} NCU_PROBE=${run%:*} NCU_PROBE_SPLITS=${run#*:} ncu_decode turboquant \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
            --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats -f -o "$OUT/$name"
        ncu_reports "$name"
        rm -f "$OUT/$name.ncu-rep"
    done
    ;;
ncu-source)   # where the decode kernels' warps stall, per SASS instruction (sampled); NCU_FORMATS picks the formats
    for fmt in ${NCU_FORMATS:-turboquant turboquant:k=q4_0,v=q4_0}; do
        name="ncu_src_${fmt//[:=,]/_}${NCU_SHAPE:+_$NCU_SHAPE}"
        ncu_decode "$fmt" --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis_Tables \
            --metrics "$STALL_RATIOS" -f -o "$OUT/$name"
        ncu_reports "$name" 10
    done
    ;;
*)
    echo "usage: bash bench/h200_run.sh kernels|tests|engine|memory|prefill|gluon-tests|gluon-window|gluon|longest-first|longest-first-engine|buckets|ragged-engine|step-kernels|prefill-gaps|off-splits|engine-shapes|split-counts|offsets32|copies-only|memory-kernels|async-memory|longest-first-probes|tail-rule|budgets|mixed-graphs|eager-steps|h200-cap96|off-ids|off-inner|off-served|h200-inner|off-layouts|write-caps|tq-lean|lean-pick|skew|skew-short|h200-first|lean-defaults|lean-engine|served|h200-lean|gpu-suite|gpu-engine|h200-pending|ncu|ncu-off|ncu-work|ncu-splits|ncu-source" >&2
    exit 2
    ;;
esac
# A device call brings back at most 8 files from its output folder: where a mode wrote more into a folder outside
# the repository, they go back as one archive, results.tar.gz (`tar -xzf results.tar.gz -C DIR` unpacks it)
out_abs=$(cd "$OUT" && pwd)
count=$(find "$out_abs" -type f | wc -l)
case "$out_abs/" in
"$PWD"/*) ;;
*)  if [ "$count" -gt 8 ]; then
        tar -czf "/tmp/h200_run_$$.tar.gz" -C "$out_abs" . && find "$out_abs" -mindepth 1 -delete \
            && mv "/tmp/h200_run_$$.tar.gz" "$out_abs/results.tar.gz" && echo "== $count files packed: $OUT/results.tar.gz"
    fi ;;
esac
exit $status
