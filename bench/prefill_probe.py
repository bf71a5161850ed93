"""Side by side on a GPU: prefill over dense pages through the Gluon kernel (`ops/triton/prefill_gluon.py`, served
on Hopper) and the tile-language varlen kernel (`ops/triton/attention.py`, served elsewhere), against SDPA causal
over a contiguous cache.

    python bench/prefill_probe.py [--out bench/results/h200/prefill_probe]
    CHUNKS='[[1, 2048, 0], [1, 2048, 8192], [4, 1024, 0]]' python bench/prefill_probe.py   # (seqs, chunk, context)

Llama-3-8B heads (32 query, 8 KV, head_dim 128), bf16, blocks of 16 on shuffled block tables, as
`bench/kernel_bench.py`. Prints a table (ms, TFLOP/s, speed against SDPA, error against SDPA) and writes OUT.json and
OUT.png.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402
import plotting  # noqa: E402  (bench/plotting.py)
from pagedkv.ops.triton import attention, prefill_gluon  # noqa: E402

CHUNKS = [tuple(c) for c in json.loads(os.environ.get(
    "CHUNKS", "[[1, 2048, 0], [1, 2048, 8192], [1, 512, 0], [1, 8192, 0], [4, 1024, 0], [8, 512, 4096]]"))]


def probe(num_seqs: int, chunk: int, context: int, gen) -> dict:
    total = context + chunk
    keys = torch.randn(num_seqs * total, kb.NUM_KV_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    query = torch.randn(num_seqs * chunk, kb.NUM_Q_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    q = query.view(num_seqs, chunk, kb.NUM_Q_HEADS, kb.HEAD_DIM).transpose(1, 2)
    k = keys.view(num_seqs, total, kb.NUM_KV_HEADS, kb.HEAD_DIM).transpose(1, 2).contiguous()
    v = values.view(num_seqs, total, kb.NUM_KV_HEADS, kb.HEAD_DIM).transpose(1, 2).contiguous()
    # SDPA: the faster of its formulations, as bench/kernel_bench.py times it
    sdpa_ms, sdpa_kind, _, sdpa_out = kb.sdpa_prefill(q, k, v, context)
    ref = sdpa_out.transpose(1, 2).reshape(num_seqs * chunk, kb.NUM_Q_HEADS, kb.HEAD_DIM)
    fmt, pages, table = kb.paged_layer("off", keys, values, num_seqs, total, gen)
    meta = kb.decode_meta(table, total, chunk)
    flops = 4 * kb.NUM_Q_HEADS * kb.HEAD_DIM * num_seqs * chunk * (context + (chunk + 1) / 2)
    row = {"num_seqs": num_seqs, "chunk": chunk, "context": context, "sdpa_kind": sdpa_kind, "sdpa_ms": sdpa_ms,
           "sdpa_tflops": flops / sdpa_ms / 1e9}
    kernels = {"varlen": lambda: attention.paged_attention(query, pages, fmt, meta, scale=kb.SCALE),
               "gluon": lambda: prefill_gluon.paged_attention(query, pages, fmt, meta, scale=kb.SCALE)}
    assert prefill_gluon.supports(query, pages, fmt, meta)
    for name, fn in kernels.items():
        row[f"{name}_err"] = kb.rel_err(fn(), ref)
        row[f"{name}_ms"] = kb.time_per_call([fn], replays=10)
        row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
    for name in kernels:
        row[f"{name}_vs_sdpa"] = row["sdpa_ms"] / row[f"{name}_ms"]
    print(f"{num_seqs:>4} x {chunk:>5} after {context:>5}: sdpa {row['sdpa_ms']:.3f} ms ({row['sdpa_tflops']:.0f} TFLOP/s)"
          + "".join(f" | {k} {row[k + '_ms']:.3f} ({row[k + '_tflops']:.0f}, x{row[k + '_vs_sdpa']:.2f}, "
                    f"err {row[k + '_err']:.1e})" for k in kernels), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/prefill_probe")
    args = parser.parse_args()
    kb.warm_up()
    gen = torch.Generator().manual_seed(0)
    rows = [probe(*c, gen) for c in CHUNKS]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    plt = plotting.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['num_seqs']}x{r['chunk']}\n+{r['context']}" for r in rows]
        plotting.grouped_bars(ax, labels, {k: [r[f"{k}_vs_sdpa"] for r in rows] for k in ("varlen", "gluon")})
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("speed / SDPA causal")
        ax.set_title(f"prefill over dense pages, {torch.cuda.get_device_name()}")
        ax.legend()
        plotting.save(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
