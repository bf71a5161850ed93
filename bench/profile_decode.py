"""GPU time of one decode call by kernel (torch.profiler): the decode kernel itself and the split reduce, per format
and shape, so that the cost of the reduce is seen apart.

    python bench/profile_decode.py --formats "off;q8;q4;turboquant" --out bench/results/h200
    python bench/profile_decode.py --formats "turboquant:k=q4_0,v=q4_0" --shapes 64x8192 --recent-tokens 128

With `--plain` the calls run without torch.profiler, for a hardware-counter profiler around the process (Nsight
Compute: `bash bench/h200_run.sh ncu`). With `--probe copies|codes|work` a TurboQuant format runs that timing probe of
its Gluon kernel instead (`decode_gluon.paged_attention_tq(probe=...)`, 16-key steps, `--probe-splits`), as
`bash bench/h200_run.sh ncu-work` profiles it; `--probe kernel` runs the kernel itself that way (at any split count).
"""
import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402
from pagedkv.ops import triton as triton_ops  # noqa: E402

SHAPES = [(1, 32768), (32, 4096), (64, 8192), (128, 2048)]


def probe_call(spec: str, q, pages, fmt, meta, probe: str, splits: int, max_registers: int | None = None):
    """One call of the TurboQuant kernel's timing probe `probe` (16-key steps, longest first) at `splits`."""
    from pagedkv.ops.triton import decode_gluon

    assert spec.startswith("turboquant"), "--probe times the TurboQuant kernel's probes: a turboquant format"
    return decode_gluon.paged_attention_tq(q, pages, fmt, meta, scale=kb.SCALE, num_splits=splits, pairs=False,
                                           ordered=True, probe=None if probe == "kernel" else probe,
                                           max_registers=max_registers)


def profile(spec: str, num_seqs: int, seq_len: int, gen: torch.Generator, calls: int = 20, plain: bool = False,
            recent_tokens: int = 0, probe: str | None = None, probe_splits: int = 2,
            probe_max_registers: int | None = None) -> dict:
    n = num_seqs * seq_len
    keys = torch.randn(n, kb.NUM_KV_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    fmt, pages, table = kb.paged_layer(spec, keys, values, num_seqs, seq_len, gen)
    meta = kb.decode_meta(table, seq_len)
    window = None
    if recent_tokens and spec != "off":   # the last tokens read exact from a dense ring (`kernel_bench.window_for`)
        meta, window = kb.window_for(table, seq_len, recent_tokens, meta, keys, values)
    q = torch.randn(num_seqs, kb.NUM_Q_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    if probe:
        for _ in range(3 + calls):
            probe_call(spec, q, pages, fmt, meta, probe, probe_splits, probe_max_registers)
        torch.cuda.synchronize()
        return {"format": spec, "batch": num_seqs, "context": seq_len, "probe": probe, "kernels_us": {}}
    for _ in range(3):
        triton_ops.paged_attention(q, pages, fmt, meta, scale=kb.SCALE, window=window)
    torch.cuda.synchronize()
    if plain:
        return {"format": spec, "batch": num_seqs, "context": seq_len, "kernels_us": {}}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            triton_ops.paged_attention(q, pages, fmt, meta, scale=kb.SCALE, window=window)
        torch.cuda.synchronize()
    us = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] += e.device_time_total / calls if hasattr(e, "device_time_total") else e.cuda_time_total / calls
    return {"format": spec, "batch": num_seqs, "context": seq_len, "window_tokens": recent_tokens if window else 0,
            "kernels_us": dict(us)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="off;q8;q4;turboquant")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES), help="batch x context, e.g. 64x8192")
    p.add_argument("--plain", action="store_true", help="the calls only, no torch.profiler (for ncu)")
    p.add_argument("--probe", choices=("copies", "codes", "work", "kernel"), default=None,
                   help="a TurboQuant format runs this probe of its Gluon kernel (with --plain, for ncu)")
    p.add_argument("--probe-splits", type=int, default=2, help="with --probe: its split count")
    p.add_argument("--probe-max-registers", type=int, default=None,
                   help="with --probe: the register cap (0: none; default: the served one)")
    p.add_argument("--recent-tokens", type=int, default=0,
                   help="quantized formats read their last tokens from a dense recent window this long")
    args = p.parse_args()
    if args.probe and not args.plain:
        p.error("--probe runs its calls for a profiler around the process (Nsight Compute): add --plain")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for num_seqs, seq_len in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        for spec in args.formats.split(";"):
            r = profile(spec, num_seqs, seq_len, gen, plain=args.plain, recent_tokens=args.recent_tokens,
                        probe=args.probe, probe_splits=args.probe_splits,
                        probe_max_registers=args.probe_max_registers)
            if args.plain:
                continue
            rows.append(r)
            print(f"{spec:26s} ({num_seqs:3d}, {seq_len:5d}): " + ", ".join(
                f"{k[:40]} {v:.1f} us" for k, v in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])), flush=True)
        torch.cuda.empty_cache()
    if args.plain:
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile_decode.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
