"""Speculative decoding: decode tokens/s with and without it, and the acceptance, per drafter.

Two workloads on the default model: input-grounded (the model is given a passage of the shared text and
asked to quote or continue it) and open-ended (free answers to questions); batch 1 (one request at a
time) and batch 16 (sixteen at once). Every request generates exactly --new-tokens tokens (EOS ignored),
greedy, so every drafter produces the same tokens as no drafter; runs alternate between drafters, and
decode tokens/s leaves out the prefill (the time of a one-token run of the same requests).

    python bench/speculative.py [--new-tokens 96] [--rounds 2] [--out bench/results]
    python bench/speculative.py --verify-cost [--batches 1 16 64] [--k 4]   # on CUDA: verify vs decode step

--verify-cost times one engine step replayed from its CUDA graph, a decode step (1 token per sequence)
against a verify step (1 + k), with an 8-layer Llama-3-8B-shaped model (random bf16 weights) over
--context tokens per sequence, then the engine's output tokens/s at the largest batch (128 new tokens per
request) with speculation on ("ngram", defaults) and off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)
from pagedkv import LLM, SamplingParams, load_model  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"
QUESTIONS = [
    "Why is the sky blue?", "Give me three tips for a job interview.", "What makes a good friend?",
    "Explain how vaccines work.", "Write a short poem about autumn.", "What is the difference between weather and climate?",
    "How do airplanes stay in the air?", "Describe a perfect weekend.", "Why do cats purr?",
    "What are the benefits of reading books?", "How does a refrigerator keep food cold?", "Tell me about the moon.",
    "What should I cook for dinner tonight?", "Why do leaves change colour in autumn?", "How do I learn to play chess?",
    "What is photosynthesis?",
]
ASKS = ["Repeat the following passage word for word.", "Quote this passage exactly, then continue it.",
        "Copy this text exactly as it is written."]
DRAFTERS = {
    "off": None,
    "ngram": "ngram:k=6",
    "draft": "draft:model=default,layers=24,k=4,adaptive=0",  # raw figures: adaptive k pauses this draft
}


def passages(n: int, words: int = 90) -> list[str]:
    """n passages of about `words` words each from the shared text, spread over the book."""
    body = TEXT.read_text(encoding="utf-8").split()
    start, stride = len(body) // 10, len(body) // (n + 12)
    return [" ".join(body[start + i * stride:start + i * stride + words]) for i in range(n)]


def workloads(tok, n: int) -> dict[str, list[list[int]]]:
    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True)["input_ids"]

    grounded = [chat(f"{ASKS[i % len(ASKS)]}\n\n{p}") for i, p in enumerate(passages(n))]
    return {"grounded": grounded, "open": [chat(q) for q in QUESTIONS[:n]]}


def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int, batch: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start, outputs = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i:i + batch], params)
    return time.perf_counter() - start, outputs


def measure(model, tok, args) -> dict:
    loads = workloads(tok, max(args.batches))
    llms = {name: LLM(model, tokenizer=tok, speculative=spec, prefix_caching=False)
            for name, spec in DRAFTERS.items() if name in args.drafters}
    results = []
    for load, prompts in loads.items():
        for batch in args.batches:
            chosen = prompts[:max(batch, args.requests_at_batch_1)] if batch == 1 else prompts[:batch]
            prefill = min(timed_generate(llms["off"], chosen, 1, batch)[0] for _ in range(2))
            runs = {name: [] for name in llms}
            stats = {}
            for _ in range(args.rounds):
                for name, llm in llms.items():
                    before = {k: v for k, v in llm.stats().items() if k.startswith("spec_")}
                    seconds, outputs = timed_generate(llm, chosen, args.new_tokens, batch)
                    runs[name].append(seconds)
                    after = llm.stats()
                    stats[name] = {k: after[k] - before.get(k, 0) for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                                                          "spec_verify_steps") if k in after}
                    stats[name]["tokens"] = [o.token_ids for o in outputs]
            decode_tokens = len(chosen) * (args.new_tokens - 1)
            base_tokens = stats["off"]["tokens"]
            for name in llms:
                seconds = statistics.median(runs[name])
                s = stats[name]
                row = dict(workload=load, batch=batch, drafter=name, requests=len(chosen), seconds=round(seconds, 3),
                           prefill_seconds=round(prefill, 3),
                           decode_tokens_per_s=round(decode_tokens / max(seconds - prefill, 1e-9), 2),
                           same_tokens_as_off=s["tokens"] == base_tokens)
                if name != "off":
                    drafted, accepted, steps = s["spec_draft_tokens"], s["spec_accepted_tokens"], s["spec_verify_steps"]
                    row.update(acceptance_rate=round(accepted / drafted, 3) if drafted else 0.0,
                               accepted_tokens_per_step=round(accepted / steps, 3) if steps else 0.0)
                results.append(row)
            off = next(r for r in results if r["workload"] == load and r["batch"] == batch and r["drafter"] == "off")
            for r in results:
                if r["workload"] == load and r["batch"] == batch:
                    r["speedup"] = round(r["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3)
                    print(json.dumps(r), flush=True)
    return {"results": results}


# ----------------------------------------------------------------------------------------------------
@torch.inference_mode()
def verify_cost(args) -> dict:
    """Median time of a decode step and of a verify step (1 + k tokens per sequence), both graph replays."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import engine_gpu

    model = engine_gpu.build_model(args.layers)
    rows = []
    for batch in args.batches:
        llm = LLM(model, kv_format=args.kv_format, num_blocks=batch * (args.context // 16 + 8),
                  max_num_batched_tokens=16384, max_num_seqs=max(args.batches),
                  speculative=f"ngram:k={args.k},adaptive=0,max_batch_size={max(args.batches) + 1}")
        engine = llm.engine
        for p in engine_gpu.random_prompts(batch, args.context, model.config.vocab_size, seed=batch):
            engine.add_request(p, SamplingParams(max_tokens=64, ignore_eos=True))
        while any(s.num_output_tokens == 0 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
            engine.step()
        seqs = list(engine.scheduler.running)
        runner, cache = engine.runner, engine.cache
        times = {}
        for name, q, call in [("decode", 1, lambda: runner.graphs.run(seqs)),
                              ("verify", 1 + args.k, lambda: runner.verify_graphs.run(
                                  seqs, [[s.token_ids[-1]] * (1 + args.k) for s in seqs]))]:
            samples = []
            for i in range(args.reps + 3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                if i >= 3:
                    samples.append(time.perf_counter() - start)
                for s in seqs:
                    cache.trim(q, s.seq_id)
                    runner.rolled_back(s.seq_id, len(cache.seqs[s.seq_id].block_ids))
            times[name] = statistics.median(samples) * 1e3
        row = dict(batch=batch, context=args.context, k=args.k, kv_format=args.kv_format,
                   decode_ms=round(times["decode"], 3), verify_ms=round(times["verify"], 3),
                   verify_over_decode=round(times["verify"] / times["decode"], 3))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del llm, engine
        torch.cuda.empty_cache()
    return {"verify_cost": rows, "gpu": torch.cuda.get_device_name(), "layers": args.layers}


def throughput(args) -> dict:
    """Engine output tokens/s at the largest batch, speculation on ("ngram") against off, alternating."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import engine_gpu

    model = engine_gpu.build_model(args.layers)
    batch = max(args.batches)
    prompts = engine_gpu.random_prompts(batch, args.context, model.config.vocab_size, seed=0)
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    runs = {"off": [], "ngram": []}
    for _ in range(args.rounds):
        for name in runs:
            llm = LLM(model, kv_format=args.kv_format, num_blocks=batch * (args.context // 16 + 12),
                      max_num_seqs=batch, max_num_batched_tokens=16384, speculative=None if name == "off" else "ngram")
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # capture graphs, compile
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            runs[name].append(batch * 128 / (time.perf_counter() - start))
            del llm
            torch.cuda.empty_cache()
    row = {name: round(statistics.median(v), 1) for name, v in runs.items()}
    row.update(batch=batch, ratio=round(row["ngram"] / row["off"], 3))
    print(json.dumps(row), flush=True)
    return row


def plot(results: list[dict], path: Path) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    drafters = [d for d in DRAFTERS if d != "off" and any(r["drafter"] == d for r in results)]
    cases = sorted({(r["workload"], r["batch"]) for r in results}, key=lambda c: (c[0] != "grounded", c[1]))
    labels = [f"{w}\nbatch {b}" for w, b in cases]

    def values(d, key):
        return [next((r.get(key, 0) for r in results if (r["workload"], r["batch"], r["drafter"]) == (*c, d)), 0)
                for c in cases]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    plotting.grouped_bars(ax1, labels, {d: values(d, "speedup") for d in drafters})
    ax1.axhline(1.0, color="grey", lw=1, ls="--")
    ax1.set_ylabel("decode tokens/s vs no speculation")
    ax1.set_title("speedup")
    ax1.legend()
    plotting.grouped_bars(ax2, labels, {d: values(d, "acceptance_rate") for d in drafters})
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("accepted / drafted tokens")
    ax2.set_title("acceptance")
    plotting.save(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per drafter; the median is kept")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests-at-batch-1", type=int, default=3, help="requests run one after another at batch 1")
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--verify-cost", action="store_true", help="CUDA: verify step vs decode step cost, then exit")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kv-format", default="off")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.verify_cost:
        if args.batches == [1, 16]:
            args.batches = [1, 16, 64]
        data = verify_cost(args)
        data["throughput"] = throughput(args)
        (out / "speculative_verify_cost.json").write_text(json.dumps(data, indent=1))
        return 0
    if "off" not in args.drafters:
        args.drafters = ["off", *args.drafters]
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, tok = load_model(args.model, dtype=dtype, device=args.device)
    data = measure(model, tok, args)
    data.update(model=args.model, device=args.device, new_tokens=args.new_tokens, rounds=args.rounds,
                threads=args.threads, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                drafters={k: v for k, v in DRAFTERS.items() if k in args.drafters})
    name = "speculative" if args.device == "cpu" else f"speculative_{args.device.split(':')[0]}"
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    plot(data["results"], out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
