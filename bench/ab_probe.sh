#!/usr/bin/env bash
# A/B of kernel source files on a GPU: the same gluon_probe.py run (served path, the split counts the launcher
# picks) with the new files, the old ones, then the new ones again, so that drift shows in the two new rounds.
#
#   mkdir -p .ab/old .ab/new                       # .ab/ is not tracked: carry it to the device
#   git show HEAD:pagedkv/ops/triton/decode_gluon.py > .ab/old/decode_gluon.py
#   cp pagedkv/ops/triton/decode_gluon.py .ab/new/
#   FORMATS="off q4 turboquant" bash bench/ab_probe.sh .ab/old .ab/new
#
# Every file in OLD and NEW replaces its namesake in pagedkv/ops/triton/; NEW's files are left in place at the end.
# Prints one line per round, format and shape: "new|old FORMAT (batch, context): sdpa .. us, default .. us (ratio)".
set -u
old=$1
new=$2
SPLITS=${SPLITS:-'{"1":[128],"32":[4],"64":[2],"128":[1]}'}
for round in new old new; do
    dir=$new
    [ "$round" = old ] && dir=$old
    cp "$dir"/*.py pagedkv/ops/triton/
    for fmt in ${FORMATS:-off q4 turboquant}; do
        FORMAT=$fmt SPLITS=$SPLITS OUT=/tmp timeout 120 python bench/gluon_probe.py 2>&1 \
            | grep -E "^\S+ \(" | sed "s/^/$round /" | cut -c1-110
    done
done
cp "$new"/*.py pagedkv/ops/triton/
