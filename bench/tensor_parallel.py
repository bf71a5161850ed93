"""The engine on 1 GPU against the engine on N GPUs (tensor parallel), same model, same requests, one run.

What a user who outgrew one GPU compares: `LLM` on rank 0 over a sharded cache (`pagedkv.parallel`),
decode steps replayed from CUDA graphs on every rank, against the same engine on one GPU.

  1. Decode tokens/s at each `--batches` size with `--context` tokens of context (the engine's own
     steps, timed after prefill and a few warm-up steps).
  2. The batch workload: `--requests` requests of `--prompt-tokens` + `--new-tokens` tokens through
     `LLM.generate`: output tokens/s, and the greedy outputs, compared between the runs (agreement).

The model is Llama-3-8B-shaped (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336, vocab
128256) with `--layers` layers, random bf16 weights, saved once to `--model-dir`; each configuration
starts its ranks (`pagedkv.parallel.launch`: NCCL on CUDA, gloo on the CPU) and loads its shard.
Prints progress, a table, and writes tensor_parallel.json and tensor_parallel.png to `--out`.

    python bench/tensor_parallel.py --device cuda --ranks 1 2 --out bench/results          # the issue's run
    python bench/tensor_parallel.py --device cpu --shape tiny --layers 2 --context 64 --batches 1 4 \\
        --requests 4 --prompt-tokens 32 --new-tokens 8 --decode-steps 4 --out /tmp/tp   # a CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)

from pagedkv.parallel import follow, install_sharded_cache, launch, lead, load_sharded_model  # noqa: E402
from pagedkv.parallel.model import check_model  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256),
    "small": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=8,
                  vocab_size=32000),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, vocab_size=512),
}
_T0 = time.perf_counter()


def say(message: str) -> None:
    """A progress line with the wall-clock time (the ranks are other processes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def save_random_model(folder: Path, shape: str, num_layers: int, dtype: torch.dtype, device: str) -> None:
    """A random Llama of `shape` with `num_layers` layers in `folder` (kept: a later run reuses it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        say(f"model: reusing {folder}")
        return
    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=num_layers, max_position_embeddings=8192,
                         rope_theta=500000.0, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    say(f"model: drawing {num_layers} layers of the {shape} shape ({dtype}) and saving them to {folder}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    init_device = "cuda" if device == "cuda" else "cpu"  # a GPU draws 8B random numbers in a moment
    model = model.to(dtype).to_empty(device=init_device)
    g = torch.Generator(init_device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    del model
    if init_device == "cuda":
        torch.cuda.empty_cache()
    say(f"model: saved to {folder}")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_step_count(batch: int, context: int, max_num_batched_tokens: int) -> int:
    """Engine steps until `batch` prompts of `context` tokens are all prefilled (chunked), one to spare."""
    return -(-batch * context // max_num_batched_tokens) + 1


def engine_decode(llm, batch: int, context: int, steps: int, warm: int, tag: str, profile_steps: int = 0) -> dict:
    """Decode tokens/s of the engine, `batch` requests at `context` tokens of context."""
    from pagedkv import SamplingParams

    engine = llm.engine
    device = engine.runner.device
    prompts = random_prompts(batch, context, engine.vocab_size, seed=batch)
    # the first prompts decode while the last ones prefill: none may finish before the timed steps end
    prefill_steps = prefill_step_count(batch, context, engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=warm + steps + prefill_steps + 2, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[r] for r in rids]
    start = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - start
    for _ in range(warm):
        engine.step()
    sync(device)
    t0, gen0, replays0 = time.perf_counter(), engine.num_generated_tokens, engine.stats()["cuda_graph_replays"]
    for _ in range(steps):
        engine.step()
    sync(device)
    dt = time.perf_counter() - t0
    out = {"tokens_per_s": (engine.num_generated_tokens - gen0) / dt, "ms_per_step": dt / steps * 1e3,
           "graph_replays": engine.stats()["cuda_graph_replays"] - replays0, "prefill_s": prefill_s,
           "mean_batch": (engine.num_generated_tokens - gen0) / steps}  # `batch` when every request decoded
    if profile_steps:
        out["replay_alone"] = replay_alone(engine, batch, device)
        out["profile"] = profile_decode(engine, profile_steps, device)
    for r in rids:
        engine.abort(r)
    say(f"{tag} decode batch {batch}: {out['tokens_per_s']:.0f} tok/s, {out['ms_per_step']:.2f} ms/step, "
        f"{out['graph_replays']} graph replays, {out['mean_batch']:.1f} requests a step (prefill {prefill_s:.1f}s)")
    return out


def replay_alone(engine, batch: int, device: torch.device, replays: int = 20) -> dict:
    """The decode step's graph replayed back to back (every rank, through the cache's peers), without the
    engine's scheduling and sampling: wall ms per replay on the leader's host and GPU ms between events."""
    import bisect

    graphs = engine.runner.graphs
    if graphs is None or device.type != "cuda":
        return {}
    bs = graphs.batch_sizes[bisect.bisect_left(graphs.batch_sizes, batch)]
    graphs.replay(bs)  # replays rewrite the last step's slots with the same keys and values
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(replays):
        graphs.replay(bs)
    end.record()
    sync(device)
    out = {"bucket": bs, "wall_ms": (time.perf_counter() - t0) / replays * 1e3,
           "gpu_ms": start.elapsed_time(end) / replays}
    say(f"replay alone, bucket {bs}: {out['wall_ms']:.2f} ms wall, {out['gpu_ms']:.2f} ms between GPU events")
    return out


def profile_decode(engine, steps: int, device: torch.device) -> dict:
    """Where the leader's decode step goes: torch.profiler over `steps` engine steps, the top CPU and device
    ops (printed, and returned for the JSON)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    events = prof.key_averages()
    def top(key, n):
        rows = sorted(events, key=lambda e: -(getattr(e, key, 0) or 0))[:n]
        return [{"name": e.key[:80], "calls": e.count, "ms_per_step": round((getattr(e, key, 0) or 0) / steps / 1e3, 4)}
                for e in rows]
    out = {"cpu_total": top("cpu_time_total", 25), "self_cpu": top("self_cpu_time_total", 25),
           "device": top("self_device_time_total", 20)}
    for name, rows in out.items():
        print(f"profile, {name} (ms per step):", flush=True)
        for r in rows:
            print(f"  {r['ms_per_step']:9.4f}  {r['calls']:6d}  {r['name']}", flush=True)
    return out


def engine_generate(llm, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    from pagedkv import SamplingParams

    device = llm.engine.runner.device
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    sync(device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    say(f"{tag} {len(prompts)} x ({len(prompts[0])} + {new_tokens}): {tokens / elapsed:.0f} output tok/s, "
        f"{elapsed:.2f}s")
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "token_ids": [o.token_ids for o in outs]}


def bench_rank(group, folder: str, dtype: torch.dtype, args: argparse.Namespace):
    from pagedkv import LLM

    if args.threads_per_rank:
        torch.set_num_threads(args.threads_per_rank)
    tag = f"[{group.world_size} rank{'s' if group.world_size > 1 else ''}]"
    t = time.perf_counter()
    model, _ = load_sharded_model(folder, group, dtype=dtype)
    if not group.is_leader:
        follow(model, group)
        return None
    say(f"{tag} shard loaded on {next(model.parameters()).device} in {time.perf_counter() - t:.1f}s")
    vocab = model.config.vocab_size
    prefill_steps = prefill_step_count(max(args.batches, default=1), args.context, args.max_num_batched_tokens)
    longest = max(args.context + args.warm_steps + args.decode_steps + prefill_steps + 4,
                  args.prompt_tokens + args.new_tokens + 1)
    num_seqs = max(max(args.batches, default=1), args.requests)
    blocks = num_seqs * -(-longest // args.block_size) + 16
    cache = install_sharded_cache(model, kv_format=args.kv_format, block_size=args.block_size, num_blocks=blocks)
    out = {"ranks": group.world_size, "device": str(next(model.parameters()).device), "decode": {}}
    with lead(model, group):
        llm = LLM(model, cache=cache, max_num_seqs=num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=longest + 1, enforce_eager=args.enforce_eager)
        for b in args.batches:
            profile_steps = args.profile_steps if b == max(args.batches) else 0
            out["decode"][b] = engine_decode(llm, b, args.context, args.decode_steps, args.warm_steps, tag,
                                             profile_steps)
        if args.requests:
            prompts = random_prompts(args.requests, args.prompt_tokens, vocab, seed=1234)
            out["generate"] = engine_generate(llm, prompts, args.new_tokens, tag)
        out["kv_bytes_per_rank"] = cache.nbytes()
        stats = cache.paged_stats()
        out["kernels"] = {k: stats.get(k) for k in ("triton_attention_calls", "reference_attention_calls")}
        del llm
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far greedy outputs agree: identical requests, and tokens before the first difference (fraction)."""
    same_prefix = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same_prefix += n
    total = sum(len(x) for x in a)
    return {"identical_requests": sum(x == y for x, y in zip(a, b)), "requests": len(a),
            "tokens_before_first_difference": same_prefix / total if total else 1.0}


def plot(results: dict, path: Path) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    runs, args = results["runs"], results["args"]
    batches = list(runs[0]["decode"])
    has_generate = all("generate" in r for r in runs)
    fig, axes = plt.subplots(1, 2 if has_generate else 1, figsize=(11 if has_generate else 7, 4),
                             gridspec_kw={"width_ratios": [3, 2]} if has_generate else None, squeeze=False)
    ax0 = axes[0][0]
    label = {r["ranks"]: f"{r['ranks']} {'GPU' if args['device'] == 'cuda' else 'rank'}{'s' if r['ranks'] > 1 else ''}"
             for r in runs}
    series = {label[r["ranks"]]: [r["decode"][b]["tokens_per_s"] for b in batches] for r in runs}
    bars = plotting.grouped_bars(ax0, [f"batch {b}" for b in batches], series)
    base = runs[0]["decode"]
    for container, r in list(zip(bars, runs))[1:]:
        ax0.bar_label(container, [f"{r['decode'][b]['tokens_per_s'] / base[b]['tokens_per_s']:.2f}x" for b in batches],
                      fontsize=8)
    ax0.set_ylabel("decode tokens/s, higher is better")
    ax0.legend(fontsize=8)
    ax0.set_title(f"decode, {args['context']} tokens of context (labels: x {label[runs[0]['ranks']]})", fontsize=9)
    if has_generate:
        ax1 = axes[0][1]
        names = [label[r["ranks"]] for r in runs]
        values = [r["generate"]["tokens_per_s"] for r in runs]
        b = ax1.barh(names, values, color=[f"C{i}" for i in range(len(runs))])
        ax1.bar_label(b, [f"{v / values[0]:.2f}x" for v in values], fontsize=8)
        ax1.invert_yaxis()
        ax1.set_xlabel("output tokens/s, higher is better")
        ax1.set_title(f"{args['requests']} requests x ({args['prompt_tokens']} + {args['new_tokens']}) tokens", fontsize=9)
    fig.suptitle(f"pagedkv engine, tensor parallel: {results['gpu']}, {args['layers']}-layer {args['shape']} shape, "
                 f"{results['dtype']}, pages {args['kv_format']}, {results['date']}", fontsize=9)
    plotting.save(fig, path)
    return True


def print_table(results: dict) -> None:
    runs, args = results["runs"], results["args"]
    base = runs[0]
    print(f"\n{results['gpu']}, torch {results['torch']}, {args['layers']}-layer {args['shape']} shape, "
          f"{results['dtype']}, pages {args['kv_format']}, {args['context']} tokens of context")
    print("| decode tokens/s | " + " | ".join(f"batch {b}" for b in args["batches"]) + " |")
    print("| --- |" + " --- |" * len(args["batches"]))
    for r in runs:
        cells = [f"{r['decode'][b]['tokens_per_s']:.0f}" + (
            f" ({r['decode'][b]['tokens_per_s'] / base['decode'][b]['tokens_per_s']:.2f}x)" if r is not base else "")
            for b in args["batches"]]
        print(f"| {r['ranks']} rank{'s' if r['ranks'] > 1 else ''} ({r['device']}) | " + " | ".join(cells) + " |")
    if all("generate" in r for r in runs):
        print(f"\n{args['requests']} requests x ({args['prompt_tokens']} + {args['new_tokens']}) tokens: output tokens/s")
        for r in runs:
            g = r["generate"]
            ratio = f" ({g['tokens_per_s'] / base['generate']['tokens_per_s']:.2f}x)" if r is not base else ""
            print(f"| {r['ranks']} rank{'s' if r['ranks'] > 1 else ''} | {g['tokens_per_s']:.0f}{ratio} | "
                  f"{g['seconds']:.2f} s |")
        for r in runs[1:]:
            a = r["agreement_with_first"]
            print(f"greedy outputs, {r['ranks']} ranks vs {base['ranks']}: {a['identical_requests']}/{a['requests']} "
                  f"requests identical, {a['tokens_before_first_difference']:.1%} of tokens before the first difference")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="configurations to run, in order")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence before decoding")
    p.add_argument("--decode-steps", type=int, default=32, help="timed engine steps per batch")
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--requests", type=int, default=64, help="requests of the batch workload (0: skip it)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-format", default="off")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed steps at the largest batch, profile this many on the leader (torch.profiler)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (to compare)")
    p.add_argument("--dtype", default=None, help="bf16 (default on CUDA) or fp32 (default on the CPU)")
    p.add_argument("--threads-per-rank", type=int, default=None, help="CPU threads of each rank")
    p.add_argument("--model-dir", default=None, help="where the random model is saved (default /tmp/pagedkv-tp-<shape>-<layers>)")
    p.add_argument("--out", default=None, help="a folder for tensor_parallel.json and tensor_parallel.png")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw the plot next to this JSON")
    args = p.parse_args(argv)
    if args.replot:
        return 0 if plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png")) else 1
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype] or (
        torch.bfloat16 if args.device == "cuda" else torch.float32)
    import transformers

    results = {"date": datetime.date.today().isoformat(),
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype).split(".")[-1],
               "args": vars(args), "command": "python bench/tensor_parallel.py " + " ".join(sys.argv[1:]), "runs": []}
    folder = Path(args.model_dir or f"/tmp/pagedkv-tp-{args.shape}-{args.layers}")
    save_random_model(folder, args.shape, args.layers, dtype, args.device)
    for n in args.ranks:
        check_model(folder, n, args.device)
        say(f"starting {n} rank{'s' if n > 1 else ''} on {args.device}")
        run = launch(bench_rank, n, args.device, str(folder), dtype, args)[0]
        if results["runs"] and "generate" in run:
            run["agreement_with_first"] = agreement(results["runs"][0]["generate"]["token_ids"],
                                                    run["generate"]["token_ids"])
        results["runs"].append(run)
    results["seconds"] = time.perf_counter() - _T0
    print_table(results)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tensor_parallel.json").write_text(json.dumps(results, indent=2, default=str))
        drew = plot(json.loads(json.dumps(results, default=str)), out / "tensor_parallel.png")
        print(f"wrote {out / 'tensor_parallel.json'}" + (f" and {out / 'tensor_parallel.png'}" if drew else ""))
    print(f"total {results['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
