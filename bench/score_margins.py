"""How far a decode split's largest attention score lies above the largest of its first 16 keys, on a real model.

    python bench/score_margins.py [--model default] [--tokens 4096] [--queries 160] [--reference split|sequence]

A decode program of the quantized kernels keeps an exact running maximum of its scores, reduced across the warp's
lanes every 16 keys. A program could instead take its first 16-key step's maximum as the reference for its whole
split and check once at the end that no score passed it by more than a margin T (log2 units; float16 P stays
below 2^T times the value scale), running the split again the exact way where one did. How often that rerun would
happen is a property of the model's attention, measured here: the model (the default one, or --model; eager
attention, float32) reads the first --tokens tokens of Pride and Prejudice; for --queries decode positions spread
over the second half, every query head, and each split count the kernels use (1, 2, 4, 8; split ranges as
`decode_gluon.split_range`), it takes d = (split maximum - first-step maximum) / ln 2 from the attention
probabilities (log p differs from the score by a per-row constant). A program is a (query, KV head, split): it
reruns if any of its group's query heads has d > T.
Prints the fraction of programs that would rerun per margin and split count; writes score_margins.json and .png
(`--reference sequence`: every split measured against the sequence's first 16 keys, where an attention sink often
is; score_margins_sequence.json and .png).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import plotting  # noqa: E402  (bench/plotting.py)
from pagedkv.models import load_model  # noqa: E402

TEXT = ROOT.parent / "shared" / "data" / "pride-and-prejudice.txt"
MARGINS = (0, 2, 4, 6, 8, 10, 12, 16)
SPLIT_COUNTS = (1, 2, 4, 8)
STEP = 16


def split_ranges(end: int, num_splits: int) -> list[tuple[int, int]]:
    """The non-empty key ranges of [0, end) the kernels' splits read (`decode_gluon.split_range`: each split's share
    of the keys, rounded up to whole steps)."""
    chunk = -(-end // (num_splits * STEP)) * STEP   # ceil(ceil(end / n) / STEP) = ceil(end / (n STEP))
    return [(lo, min(lo + chunk, end)) for lo in range(0, end, chunk)]


def layer_margins(weights: torch.Tensor, queries: list[int], group: int, reference: str) -> dict[int, torch.Tensor]:
    """Split count -> d of every (query, KV head, split) program of one layer (the largest over its query heads),
    from attention probabilities [heads, T, T]; the reference maximum is the split's first 16 keys' ("split") or the
    sequence's ("sequence": the same 16 keys, those of a first block, for every split)."""
    logp = weights[:, queries, :].double().clamp_min(1e-300).log()   # only the sampled rows: [heads, queries, T]
    out = {}
    for n in SPLIT_COUNTS:
        ds = []
        for i, t in enumerate(queries):
            row = logp[:, i, : t + 1]
            for lo, hi in split_ranges(t + 1, n):
                first = lo if reference == "split" else 0
                d = (row[:, lo:hi].amax(dim=1) - row[:, first:min(first + STEP, t + 1)].amax(dim=1)) / math.log(2)
                ds.append(d.view(-1, group).amax(dim=1))
        out[n] = torch.stack(ds).flatten()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="the default model, a transformers folder or a GGUF file")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=160)
    parser.add_argument("--reference", choices=("split", "sequence"), default="split",
                        help="the maximum a split is measured against: its own first 16 keys, or the sequence's")
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    model.set_attn_implementation("eager")
    ids = tokenizer(Path(args.text).read_text(encoding="utf-8"), return_tensors="pt").input_ids[:, : args.tokens]
    tokens = ids.shape[1]
    queries = sorted({tokens // 2 + (tokens // 2 - 1) * i // max(args.queries - 1, 1) for i in range(args.queries)})
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    margins: dict[int, list[torch.Tensor]] = {n: [] for n in SPLIT_COUNTS}
    per_layer: list[dict] = []

    def hook(module, inputs, output):
        layer = len(per_layer)
        found = layer_margins(output[1][0], queries, group, args.reference)
        over8 = {n: (d > 8).float().mean().item() for n, d in found.items()}
        for n, d in found.items():
            margins[n].append(d)
        per_layer.append({"layer": layer, **{f"splits{n}_over8": share for n, share in over8.items()}})
        print(f"  layer {layer:2d}: programs over a margin of 8, by split count: "
              + ", ".join(f"{n}: {100 * share:.2f}%" for n, share in over8.items()), flush=True)

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    print(f"{tokens} tokens, {len(queries)} decode positions ({queries[0]}-{queries[-1]}), "
          f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads, {len(model.model.layers)} layers",
          flush=True)
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    rows = []
    first = "its first 16 keys'" if args.reference == "split" else "the sequence's first 16 keys'"
    print(f"\nprograms (query, KV head, split) whose split maximum passes {first} by more than T (log2):")
    print(f"{'T':>4s} " + " ".join(f"{f'{n} split' + ('s' if n > 1 else ''):>10s}" for n in SPLIT_COUNTS))
    for t in MARGINS:
        row = {"margin": t}
        for n in SPLIT_COUNTS:
            d = torch.cat(margins[n])
            row[f"splits{n}"] = (d > t).float().mean().item()
        rows.append(row)
        print(f"{t:4d} " + " ".join(f"{100 * row[f'splits{n}']:9.2f}%" for n in SPLIT_COUNTS))
    result = {"model": args.model, "reference": args.reference, "tokens": tokens, "queries": queries, "rows": rows,
              "per_layer": per_layer, "programs": {n: int(sum(d.numel() for d in margins[n])) for n in SPLIT_COUNTS},
              "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "score_margins" + ("" if args.reference == "split" else "_sequence")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plt = plotting.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for n in SPLIT_COUNTS:
            ax.plot(MARGINS, [100 * r[f"splits{n}"] for r in rows], marker="o", label=f"{n} split{'s' if n > 1 else ''}")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_xlabel(f"margin T over {first} maximum (log2 units)")
        ax.set_ylabel("programs whose split passes it, %")
        ax.set_title(f"{Path(args.model).name} model, {tokens} tokens: decode programs over the margin")
        ax.legend()
        plotting.save(fig, out / f"{name}.png")
    print(f"wrote {out / name}.json ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
