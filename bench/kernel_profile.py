"""One decode attention call per format under Nsight Compute: what bounds the kernel (throughput, stalls,
occupancy), on a CUDA device.

    ncu --clock-control none --set full -k regex:decode_kernel -c 1 -o q4 python bench/kernel_profile.py --format q4
    ncu --import q4.ncu-rep --page details

The call is the decode benchmark's (`bench/kernel_bench.py`): Llama-3-8B heads, block 16, shuffled block tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_bench as kb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="q4")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=2, help="calls after the first (which compiles)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    n = args.batch * args.context
    keys = torch.randn(n, kb.NUM_KV_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    fmt, pages, table = kb.paged_layer(args.format, keys, values, args.batch, args.context, gen)
    meta = kb.decode_meta(table, args.context)
    query = torch.randn(args.batch, kb.NUM_Q_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    for _ in range(1 + args.calls):
        kb.triton_ops.paged_attention(query, pages, fmt, meta, scale=kb.SCALE)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
