"""Side by side on a GPU: a Gluon decode kernel (`ops/triton/decode_gluon.py`) against the default decode over the
same pages, at each of a few split counts and VARIANTS (JSON: name -> keyword arguments of its launcher).

    FORMAT=turboquant VARIANTS='{"ring2": {}, "ring3": {"stages": 3}}' python bench/gluon_probe.py
    FORMAT=q4 SHAPES='[[128, 4096]]' ORDERED=1 python bench/gluon_probe.py   # other shapes; blocks in order
    FORMAT=turboquant VARIANTS='{"keys16": {"pairs": false}, "keys32": {"pairs": true}}' python bench/gluon_probe.py
    FORMAT=off SPLITS='{"32": [2, 4], "64": [1, 2]}' python bench/gluon_probe.py   # these split counts there
    FORMAT=turboquant VARIANTS='{"lf": {"ordered": true}, "copies": {"ordered": true, "probe": "copies"}}' \
        python bench/gluon_probe.py   # the kernel beside its page reads alone (their error is not attention's: ~1)
                                      # ("probe": "work": the step's work without the copies)

SPREAD=f (0 < f < 1) gives the sequences of a shape different lengths, as an engine's batch has them: spread evenly
from (1 - f) x context to context, in shuffled order (SPREAD=0.5 at context 2,048: 1,024-2,048 tokens); the time
of each kernel is then also given as the rate it reads the pages at (SDPA's time stays that of the full length).

    FORMAT=q4 SHAPES='[[128, 2048]]' SPREAD=0.5 SPLITS='{"128": [1, 2, 4]}' python bench/gluon_probe.py

SHAPES (JSON list of [batch, context]) replaces the four target shapes; a batch without its own split counts gets
half, one and two times the split count that fills PROGRAMS_PER_SM programs per multiprocessor; SPLITS (JSON: batch ->
split counts) replaces the split counts timed, and a variant's own "splits" (the same JSON) replaces them for it.
ORDERED=1 lays each sequence's blocks out in order instead of shuffled. NAME=x: the results are written as
gluon_probe_<format>_x.{json,png}.

    FORMAT=off VARIANTS='{"served": {"ordered": true}, "inner": {"ordered": true, "inner": 4, "heads": 2,
        "splits": {"32": [1], "64": [1]}}}' SPLITS='{"32": [4], "64": [2]}' SHAPES='[[32, 4096], [64, 8192]]' \
        python bench/gluon_probe.py   # splits inside a program beside the served ones
"""
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402
from pagedkv.ops import reference  # noqa: E402
from pagedkv.ops import triton as triton_ops  # noqa: E402
from pagedkv.ops.triton import decode_gluon, decode_io  # noqa: E402
import plotting  # noqa: E402  (bench/plotting.py)

SHAPES = [tuple(s) for s in json.loads(os.environ.get("SHAPES", "[[1, 32768], [32, 4096], [64, 8192], [128, 2048]]"))]
VARIANTS = json.loads(os.environ.get("VARIANTS", '{"ring2": {}}'))
FORMAT = os.environ.get("FORMAT", "q8")
SPLITS = {1: [64, 128, 256], 32: [4, 8, 16], 64: [2, 4, 8], 128: [1, 2, 4]}
if "SPLITS" in os.environ:
    SPLITS = {int(b): counts for b, counts in json.loads(os.environ["SPLITS"]).items()}
ORDERED = os.environ.get("ORDERED", "0") == "1"
SPREAD = float(os.environ.get("SPREAD", "0"))


def lengths(num_seqs: int, seq_len: int) -> list[int]:
    """The sequences' lengths: all `seq_len`, or with SPREAD evenly from (1 - SPREAD) * seq_len to seq_len, shuffled
    (a fixed order, the same for every variant)."""
    if SPREAD <= 0:
        return [seq_len] * num_seqs
    low = max(1, round(seq_len * (1 - SPREAD)))
    lens = [low + round((seq_len - low) * i / max(num_seqs - 1, 1)) for i in range(num_seqs)]
    order = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(num_seqs)).tolist()
    return [lens[i] for i in order]


def splits_for(num_seqs: int) -> list[int]:
    if num_seqs in SPLITS:
        return SPLITS[num_seqs]
    sms = torch.cuda.get_device_properties(kb.DEV).multi_processor_count
    s = max(1, decode_gluon.PROGRAMS_PER_SM * sms // (num_seqs * kb.NUM_KV_HEADS))
    return sorted({max(1, s // 2), s, 2 * s})


def probe(num_seqs: int, seq_len: int, gen: torch.Generator) -> dict:
    n = num_seqs * seq_len
    keys = torch.randn(n, kb.NUM_KV_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    values = torch.randn(n, kb.NUM_KV_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
    copies = kb.copies_for(n * kb.NUM_KV_HEADS * kb.HEAD_DIM * 4)
    queries = [torch.randn(num_seqs, kb.NUM_Q_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
               for _ in range(copies)]
    sdpa_ms, _, _, _ = kb.sdpa_decode(keys, values, num_seqs, seq_len, queries, copies)
    layers = [kb.paged_layer(FORMAT, keys, values, num_seqs, seq_len, None if ORDERED else gen)
              for _ in range(kb.copies_for(n * kb.NUM_KV_HEADS * 264))]
    lens = lengths(num_seqs, seq_len)
    metas = [kb.decode_meta(t, lens) for _, _, t in layers]   # the engine's launch order (the default's column)
    # the variants launch in grid order, or longest first with "ordered": the order is made here, since timing
    # captures CUDA graphs, where the host-to-device copy of `decode_io.longest_first_on_device` cannot run
    grid_metas = [dataclasses.replace(m, token_order=None) for m in metas]
    ordered_metas = ([m if m.token_order is not None else
                      dataclasses.replace(m, token_order=decode_io.longest_first_on_device(m, num_seqs)) for m in metas]
                     if any(o.get("ordered") for o in VARIANTS.values()) else grid_metas)

    def calls(fn, ms=metas):
        return [lambda q=queries[i % copies], p=p, f=f, m=m: fn(q, p, f, m)
                for i, ((f, p, _), m) in enumerate(zip(layers, ms))]

    launch, _ = decode_gluon.launcher(layers[0][0], queries[0], kb.BLOCK_SIZE, kernels=decode_gluon.KERNELS)
    k = min(num_seqs, 2)
    sub = kb.decode_meta(layers[0][2][:k], lens[:k])
    ref = reference.paged_attention(queries[0][:k], layers[0][1], layers[0][0], sub, scale=kb.SCALE)
    row = {"batch": num_seqs, "context": seq_len, "sdpa_us": sdpa_ms * 1e3, "spread": SPREAD,
           "mean_length": sum(lens) / num_seqs, "page_bytes": sum(lens) * layers[0][0].bytes_per_token()}
    row["default_us"] = kb.time_per_call(calls(lambda q, p, f, m: triton_ops.paged_attention(q, p, f, m, scale=kb.SCALE))) * 1e3
    for name, opts in VARIANTS.items():
        opts = dict(opts)
        own = opts.pop("splits", {})   # a variant's own split counts: batch -> counts
        for sp in own.get(str(num_seqs), splits_for(num_seqs)):
            o = launch(queries[0][:k], layers[0][1], layers[0][0], sub, scale=kb.SCALE, num_splits=sp, **opts)
            row[f"gluon_{name}_split{sp}_err"] = kb.rel_err(o, ref)
            row[f"gluon_{name}_split{sp}_us"] = kb.time_per_call(calls(
                lambda q, p, f, m, sp=sp, opts=opts: launch(q, p, f, m, scale=kb.SCALE, num_splits=sp, **opts),
                ordered_metas if opts.get("ordered") else grid_metas)) * 1e3
    best = min((v, kk) for kk, v in row.items() if kk.startswith("gluon") and kk.endswith("_us"))
    print(f"{FORMAT} ({num_seqs}, {seq_len}): sdpa {row['sdpa_us']:.1f} us, default {row['default_us']:.1f} us "
          f"({row['default_us'] / row['sdpa_us']:.3f}), gluon best {best[1]} {best[0]:.1f} us ({best[0] / row['sdpa_us']:.3f}); "
          + ", ".join(f"{kk} {v:.3g}" for kk, v in row.items() if kk.startswith("gluon") and kk.endswith("us")), flush=True)
    print("  errors " + ", ".join(f"{v:.2g}" for kk, v in row.items() if kk.endswith("err")), flush=True)
    if SPREAD > 0:
        print(f"  lengths {min(lens)}-{max(lens)} (mean {row['mean_length']:.0f}); pages read at, TB/s: default "
              f"{row['page_bytes'] / row['default_us'] / 1e6:.2f}, " + ", ".join(
                  f"{kk.removesuffix('_us')} {row['page_bytes'] / v / 1e6:.2f}" for kk, v in row.items()
                  if kk.startswith("gluon") and kk.endswith("_us")), flush=True)
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Time / SDPA per shape: the default decode and each variant at its best split count; with SPREAD (lengths
    that differ, SDPA timed at the full length) the rate the pages are read at instead."""
    plt = plotting.pyplot()
    if plt is None:
        return
    labels = [f"B={r['batch']}\nS={r['context']}" for r in rows]

    def value(r, us):
        return r["page_bytes"] / us / 1e6 if SPREAD > 0 else us / r["sdpa_us"]

    series = {"default decode": [value(r, r["default_us"]) for r in rows]}
    for name in VARIANTS:
        series[f"Gluon {name}"] = [value(r, min(v for k, v in r.items() if k.startswith(f"gluon_{name}_split")
                                                 and k.endswith("_us"))) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plotting.grouped_bars(ax, labels, series)
    if SPREAD > 0:
        ax.set_ylabel("pages read, TB/s (higher is better)")
        ax.set_title(f"{FORMAT} pages, lengths over the top {SPREAD:g} of the context: best split count each")
    else:
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("decode time / SDPA bf16 time (lower is better)")
        ax.set_title(f"{FORMAT} pages: Gluon decode beside the default, best split count each")
    ax.legend(fontsize=7)
    plotting.save(fig, path)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    kb.warm_up()
    rows = []
    for num_seqs, seq_len in SHAPES:
        rows.append(probe(num_seqs, seq_len, gen))
        torch.cuda.empty_cache()
    name = "gluon_probe_" + re.sub(r"[^A-Za-z0-9]+", "_", FORMAT) + (f"_spread{SPREAD:g}" if SPREAD > 0 else "")
    name += f"_{os.environ['NAME']}" if os.environ.get("NAME") else ""
    out = Path(os.environ.get("OUT", "bench/results")) / (name + ".json")
    out.write_text(json.dumps(rows, indent=1))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
