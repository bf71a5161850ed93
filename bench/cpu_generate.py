"""Greedy generation tokens/s on the CPU: PagedKVCache vs transformers' DynamicCache, side by side.

Runs alternate (dynamic, paged, dynamic, paged, ...) over the same prompts so machine noise hits both;
the table shows the median tokens/s of each and their ratio. Writes JSON and a PNG plot.

    python bench/cpu_generate.py [--model default] [--runs 3] [--new-tokens 128] [--threads 2] [--formats off]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)
import pagedkv  # noqa: E402
from pagedkv.hf import cache_kwarg  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a lighthouse keeper.",
    "Explain how a paged key/value cache works.",
]


def run_once(model, tok, prompt, cache, new_tokens):
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             **{cache_kwarg(model): cache})
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts to use")
    ap.add_argument("--formats", default="off", help="comma-separated page formats to measure against DynamicCache")
    ap.add_argument("--out", default="bench/results/cpu_generate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = pagedkv.load_model(args.model)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    names = ["DynamicCache"] + [f"paged:{f}" for f in formats]
    results = {n: [] for n in names}
    run_once(model, tok, PROMPTS[0], DynamicCache(), 8)  # warm up both paths
    run_once(model, tok, PROMPTS[0], pagedkv.install_paged_kv_cache(model), 8)
    prompts = PROMPTS[: max(1, args.prompts)]
    total = args.runs * len(prompts) * len(names)
    done = 0
    for r in range(args.runs):
        for prompt in prompts:
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                if name == "DynamicCache":
                    model.set_attn_implementation("sdpa")  # transformers' own path, untouched
                    cache = DynamicCache()
                else:
                    cache = pagedkv.install_paged_kv_cache(model, kv_format=name.split(":", 1)[1])
                results[name].append(run_once(model, tok, prompt, cache, args.new_tokens))
                done += 1
                print(f"\r[{done}/{total}] {name:<24} {results[name][-1]:6.2f} tok/s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    base = statistics.median(results["DynamicCache"])
    rows = []
    print(f"\nSmolLM2 greedy, {args.new_tokens} new tokens, {args.threads} threads, {args.runs} runs x {len(prompts)} prompts")
    print(f"{'cache':<26}{'median tok/s':>14}{'ratio vs DynamicCache':>24}")
    for name in names:
        med = statistics.median(results[name])
        rows.append({"cache": name, "median_tokens_per_s": med, "ratio": med / base, "samples": results[name]})
        print(f"{name:<26}{med:>14.2f}{med / base:>24.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": args.model, "new_tokens": args.new_tokens,
                                                    "threads": args.threads, "rows": rows}, indent=2))
    plt = plotting.pyplot()
    if plt is None:
        print(f"wrote {out.with_suffix('.json')} (matplotlib missing: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["cache"] for r in rows], [r["median_tokens_per_s"] for r in rows], color=["#888"] + ["#3a7"] * len(formats))
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"SmolLM2 greedy decode on CPU ({args.threads} threads)")
    plotting.save(fig, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")

if __name__ == "__main__":
    main()
