"""What the split reduce adds to a decode call at the kernel table's shapes: each format's served decode timed beside
the same call with the reduce left out (`split_k.reduce_splits` and `reduce_with_window` made no-ops, so only the
page kernel runs; its output is then not attention's), and SDPA. If the difference is what `off` misses SDPA by,
the reduce's tail (the merge that starts only once the last page program is done) is the gap.

    python bench/reduce_tail_probe.py [--formats "off;turboquant"] [--shapes 32x4096,64x8192] [--out DIR]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402
from pagedkv.ops.triton import split_k  # noqa: E402


def without_reduce(calls):
    """`calls` run with the split reduce left out (each call patches it for its own duration)."""
    def wrap(call):
        def run():
            saved = split_k.reduce_splits, split_k.reduce_with_window
            split_k.reduce_splits = split_k.reduce_with_window = lambda *args, **kwargs: None
            try:
                return call()
            finally:
                split_k.reduce_splits, split_k.reduce_with_window = saved
        return run
    return [wrap(c) for c in calls]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="off;q4;turboquant")
    p.add_argument("--shapes", default="32x4096,64x8192,128x2048,1x32768")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    kb.warm_up()
    rows = []
    for num_seqs, seq_len in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        keys, values, queries, copies = kb.decode_inputs(num_seqs, seq_len)
        sdpa_ms = kb.sdpa_decode(keys, values, num_seqs, seq_len, queries, copies)[0]
        for spec in args.formats.split(";"):
            layers, metas = kb.decode_copies(spec, keys, values, num_seqs, seq_len, gen)
            calls = kb.decode_calls(layers, metas, queries)
            served = kb.time_per_call(calls)
            pages_only = kb.time_per_call(without_reduce(calls))
            served_again = kb.time_per_call(calls)
            row = {"format": spec, "batch": num_seqs, "context": seq_len, "sdpa_us": sdpa_ms * 1e3,
                   "served_us": min(served, served_again) * 1e3, "served_runs_us": [served * 1e3, served_again * 1e3],
                   "without_reduce_us": pages_only * 1e3}
            rows.append(row)
            print(f"{spec:12s} ({num_seqs:3d}, {seq_len:5d}): SDPA {row['sdpa_us']:7.1f} us, served "
                  f"{served * 1e3:7.1f} / {served_again * 1e3:7.1f} ({row['served_us'] / row['sdpa_us']:.3f}), "
                  f"without the reduce {row['without_reduce_us']:7.1f} ({row['without_reduce_us'] / row['sdpa_us']:.3f})",
                  flush=True)
            del layers, metas, calls
        del keys, values, queries
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "reduce_tail_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
