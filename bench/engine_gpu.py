"""Engine throughput on a GPU: pagedkv's engine against transformers' own loops, side by side in one run.

  1. Decode tokens/s with `--context` tokens of context at each `--batches` size:
     transformers' eager loop over a `DynamicCache`, then the pagedkv engine (CUDA-graph decode) for
     each `--formats` page format, and the same engine with graphs off at the largest batch.
  2. `--requests` requests of `--prompt-tokens` prompt tokens and `--new-tokens` new tokens each:
     transformers' `generate_batch` (continuous batching) against `LLM.generate`.
  `--same-memory GIB` runs instead the same-memory comparison: every `--formats` page format gets the same
     GIB of pages (as many blocks as fit), and `--requests` requests of `--prompt-tokens` + `--new-tokens`
     tokens (EOS ignored) run through `LLM.generate`, as many at once as the pages allow (the engine's own
     scheduling): output tokens/s and preemptions per format (and per `--admission-lookahead-tokens` value
     when several are given), in engine_memory.{json,png}. The issue's run:
     `--same-memory 2 --requests 256 --prompt-tokens 1024 --new-tokens 1024 --formats off q8 q4 turboquant`.

The model is Llama-3-8B-shaped (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336, vocab
128256) with `--layers` layers, randomly initialised in bf16; every request ignores EOS, so each side
does the same work. Prints a table and writes JSON to `--out`.

    python bench/engine_gpu.py --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.cache import PagedKVCache  # noqa: E402
from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.hf import cache_kwarg  # noqa: E402
from scheduler_sim import page_bytes_per_token  # noqa: E402  (bench/scheduler_sim.py)


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(num_layers: int, tiny: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256)
    if tiny:  # a smoke test of this script on the CPU
        shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    # Llama-3-8B's window is 8,192 positions; twice that lets decode run past a full 8,192-token prompt.
    config = LlamaConfig(**shape, num_hidden_layers=num_layers, max_position_embeddings=16384,
                         rope_theta=500000.0, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    return model.eval()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def ragged_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of these lengths (`random_prompts`' when they are all equal)."""
    if len(set(lengths)) == 1:
        return random_prompts(len(lengths), lengths[0], vocab, seed)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def spread_lengths(n: int, mean: int, spread: float, seed: int) -> list[int]:
    """n lengths uniform over mean x (1 - spread) .. mean x (1 + spread), seeded; all `mean` at spread 0."""
    g = torch.Generator().manual_seed(seed)
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def free_memory():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def dynamic_cache_decode(model, batch: int, context: int, steps: int, warm: int = 3) -> float:
    """transformers' eager decode loop over a DynamicCache: tokens/s with `context` tokens of context."""
    from transformers import DynamicCache

    kw = cache_kwarg(model)
    ids = torch.tensor(random_prompts(batch, context, model.config.vocab_size, seed=batch), device=DEVICE)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    del out, ids
    for i in range(warm + steps):
        if i == warm:
            sync()
            start = time.perf_counter()
        token = model(input_ids=token, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[:, -1].argmax(-1, keepdim=True)
    sync()
    elapsed = time.perf_counter() - start
    del cache
    free_memory()
    return batch * steps / elapsed


def kernel_group(name: str) -> str:
    lowered = name.lower()
    if "attention" in lowered or "reduce_splits" in lowered or "decode_kernel" in lowered or lowered.startswith("decode_"):
        return "paged attention"
    if "write" in lowered or "encode" in lowered:
        return "cache write"
    if any(k in lowered for k in ("gemm", "gemv", "cutlass", "nvjet", "sm90", "cublas", "matmul")):
        return "matmul"
    return "other"


def profile_replay(graphs, batch: int, replays: int = 20) -> dict:
    """GPU time of the decode step alone (graph replays timed with CUDA events), and where it goes."""
    import bisect

    bs = graphs.batch_sizes[bisect.bisect_left(graphs.batch_sizes, batch)]
    graph = graphs.graphs[bs]  # replays rewrite the last step's slots with the same keys/values
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    sync()
    out = {"gpu_ms_per_step": start.elapsed_time(end) / replays}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            sync()
        groups: dict[str, float] = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t and not e.key.startswith("cudaGraph"):
                groups[kernel_group(e.key)] = groups.get(kernel_group(e.key), 0.0) + t / 5 / 1e3
        out["gpu_ms_by_kernel_group"] = {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}
    except Exception as exc:  # the breakdown is a bonus; the event timing above is the number
        out["gpu_ms_by_kernel_group"] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def host_profile(engine, steps: int, top: int = 20) -> dict:
    """Where the host's time goes in `steps` eager engine steps (cProfile, ms per step): the functions with the
    most time of their own, and the engine's own layers by cumulative time. An eager step at batch 64 took 23-28 ms
    against 4.4 ms replayed, so what is not the GPU's shows here."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(steps):
        engine.step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own time, cumulative, callers)

    def name(key):
        file, line, func = key
        return f"{Path(file).name}:{line}({func})" if line else func

    def table(rows, col):  # col 2: own time, 3: cumulative
        return {name(k): {"ms_per_step": round(v[col] / steps * 1e3, 3), "calls_per_step": v[0] / steps} for k, v in rows}

    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    cumulative = sorted(((k, v) for k, v in stats.items() if "pagedkv" in k[0]), key=lambda kv: -kv[1][3])[:top]
    total = sum(v[2] for v in stats.values()) / steps * 1e3
    return {"ms_per_step": round(total, 3), "own_time": table(own, 2), "pagedkv_cumulative": table(cumulative, 3)}


def prefill_step_count(batch: int, context: int, max_num_batched_tokens: int) -> int:
    """Engine steps until `batch` prompts of `context` tokens are all prefilled (chunked), one to spare."""
    return -(-batch * context // max_num_batched_tokens) + 1


def engine_decode(llm: LLM, batch: int, context: int, steps: int, eager_steps: int = 0, warm: int = 3,
                  profile: bool = False) -> dict:
    """Decode tokens/s of the pagedkv engine, `batch` requests at `context` tokens of context."""
    engine = llm.engine
    prompts = random_prompts(batch, context, engine.vocab_size, seed=batch)
    # the first prompts decode while the last ones prefill: none may finish before the timed steps end
    prefill_steps = prefill_step_count(batch, context, engine.config.max_num_batched_tokens)
    eager_total = warm + eager_steps * (2 if profile else 1) if eager_steps else 0  # warmed, timed, then profiled
    params = SamplingParams(max_tokens=warm + steps + eager_total + prefill_steps + 2, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[r] for r in rids]
    start = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    sync()
    prefill_s = time.perf_counter() - start
    for _ in range(warm):
        engine.step()

    def timed(n):
        sync()
        t0, gen0, replays0 = time.perf_counter(), engine.num_generated_tokens, engine.stats()["cuda_graph_replays"]
        for _ in range(n):
            engine.step()
        sync()
        dt = time.perf_counter() - t0
        tokens = engine.num_generated_tokens - gen0
        return tokens / dt, dt / n * 1e3, engine.stats()["cuda_graph_replays"] - replays0, tokens / n

    tok_s, ms_per_step, replays, mean_batch = timed(steps)
    out = {"tokens_per_s": tok_s, "ms_per_step": ms_per_step, "graph_replays": replays, "prefill_s": prefill_s,
           "mean_batch": mean_batch}  # tokens per step: `batch` when every request decoded in every timed step
    if profile and engine.runner.graphs is not None:
        try:
            out.update(profile_replay(engine.runner.graphs, batch))
        except Exception as exc:
            out["profile_error"] = f"{type(exc).__name__}: {exc}"
    if eager_steps:
        graphs, engine.runner.graphs = engine.runner.graphs, None
        for _ in range(warm):  # kernels for the eager shapes compile here, not in the timed steps
            engine.step()
        out["eager_tokens_per_s"], out["eager_ms_per_step"], _, _ = timed(eager_steps)
        if profile:
            out["eager_host_ms"] = host_profile(engine, eager_steps)
        engine.runner.graphs = graphs
    for r in rids:
        engine.abort(r)
    assert engine.cache.pool.num_used == 0
    return out


def generate_batch_run(model, prompts: list[list[int]], new_tokens: int) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync()
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    del out
    free_memory()
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


TIMELINE_COLUMNS = ["seconds", "running", "waiting", "blocks_used", "graph_replays", "preemptions"]


def engine_generate_run(llm: LLM, prompts: list[list[int]], new_tokens: int | list[int],
                        timeline: bool = False) -> dict:
    """`LLM.generate`'s loop over `prompts` (EOS ignored; new_tokens: for all, or one per prompt): output tokens/s
    and TTFT. With `timeline`, also one row per engine step (`TIMELINE_COLUMNS`; replays and preemptions counted
    from this run's start), read from attributes (no stats dict, no sync)."""
    engine = llm.engine
    sched, pool, graphs = engine.scheduler, engine.cache.pool, engine.runner.graphs
    replays0, preemptions0 = (graphs.num_replays if graphs else 0), sched.num_preemptions
    rows = []
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in counts]
    sync()
    start = time.perf_counter()
    seqs = [engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    for seq in seqs:
        engine.add(seq)
    while engine.has_unfinished():
        engine.step()
        if timeline:
            rows.append([round(time.perf_counter() - start, 5), len(sched.running), len(sched.waiting), pool.num_used,
                         (graphs.num_replays if graphs else 0) - replays0, sched.num_preemptions - preemptions0])
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(s.num_output_tokens for s in seqs)
    ttft = sorted(s.metrics.first_token_time - s.metrics.arrival_time for s in seqs)
    out = {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed, "ttft_p50_s": ttft[len(ttft) // 2]}
    if timeline:
        out["timeline"] = {"columns": TIMELINE_COLUMNS, "rows": rows}
    return out


@contextlib.contextmanager
def attention_free():
    """Every paged cache's attention returns zeros while inside (its writes run as before): a same-memory run under
    it keeps the schedule of the real one (EOS is ignored, so the tokens do not matter) and times everything but
    attention, the bound on what any attention kernel could give that run."""
    real = PagedKVCache.attention

    def zeros(self, layer_idx, query, **kwargs):
        return torch.zeros_like(query)

    PagedKVCache.attention = zeros
    try:
        yield
    finally:
        PagedKVCache.attention = real


def same_memory_run(model, fmt: str, budget_bytes: int, prompts: list[list[int]], new_tokens: int | list[int],
                    max_num_batched_tokens: int, admission_lookahead_tokens: int = 1024, swap: bool = False,
                    compile_layers: bool | None = None, graph_batch_sizes: list[int] | None = None,
                    profile_kernels: bool = False, mixed_graph_tokens: int = 0) -> dict:
    """`LLM.generate` over pages of `fmt` holding at most `budget_bytes` (all layers), every request admitted
    as the pages allow: output tokens/s, preemptions, how many blocks the budget bought, and the run's timeline
    (one row per engine step, see `engine_generate_run`). swap: a preempted request's blocks go to a host tier
    as large as the pages and come back on readmission (`swap_on_preemption`), instead of being recomputed.
    profile_kernels: the timed run under torch.profiler, its kernels' total times kept as "kernels" (`kernel_totals`)."""
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    block_size = 16
    bytes_per_token = page_bytes_per_token(fmt, text.num_key_value_heads, head_dim, text.num_hidden_layers)
    num_blocks = budget_bytes // (bytes_per_token * block_size)
    options = dict(cpu_cache_gb=budget_bytes / 2**30, swap_on_preemption=True) if swap else {}
    if graph_batch_sizes:
        options["cuda_graph_batch_sizes"] = tuple(graph_batch_sizes)
    if mixed_graph_tokens:
        options["cuda_graph_mixed_tokens"] = mixed_graph_tokens
    llm = LLM(model, kv_format=fmt, num_blocks=num_blocks, max_num_seqs=len(prompts),
              max_num_batched_tokens=max_num_batched_tokens, admission_lookahead_tokens=admission_lookahead_tokens,
              compile_layers=compile_layers, async_scheduling=ASYNC_SCHEDULING, **options)
    # as many other requests of the same length for a few tokens first, so that the kernels' first-use compilation
    # is not timed (a cold Triton cache cut the measured tokens/s by 1.2-1.6x): full prefill steps, mixed steps and
    # decode batches of every size compile here (four short requests left some to the timed run: TurboQuant 13,740
    # tokens/s against 16,083 with the cache warm from an earlier run). Other tokens, so that the prefix cache
    # shares nothing with the timed requests; their steps are left out of the counts
    engine_generate_run(llm, ragged_prompts([len(p) for p in prompts], text.vocab_size, seed=99), 4)
    warm = llm.stats()
    if profile_kernels:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            out = engine_generate_run(llm, prompts, new_tokens, timeline=True)
        out["kernels"] = kernel_totals(prof)
    else:
        out = engine_generate_run(llm, prompts, new_tokens, timeline=True)
    stats = {k: (llm.stats().get(k) or 0) - (warm.get(k) or 0)
             for k in ("preemptions", "steps", "steps_queued_ahead", "cuda_graph_replays", "cuda_graph_mixed_replays",
                       "tier_host_hits", "tier_offloaded_blocks")}
    out.update(format=fmt, num_blocks=num_blocks, bytes_per_token=bytes_per_token, async_scheduling=llm.engine.async_scheduling,
               tokens_that_fit=num_blocks * block_size, preemptions=stats["preemptions"],
               admission_lookahead_tokens=admission_lookahead_tokens, swap_on_preemption=swap, steps=stats["steps"],
               steps_queued_ahead=stats["steps_queued_ahead"], cuda_graph_replays=stats["cuda_graph_replays"],
               cuda_graph_mixed_replays=stats["cuda_graph_mixed_replays"], max_num_batched_tokens=max_num_batched_tokens,
               cuda_graph_mixed_tokens=mixed_graph_tokens,
               mean_batch=out["output_tokens"] / max(1, stats["steps"]),
               blocks_swapped_in=stats["tier_host_hits"], blocks_offloaded=stats["tier_offloaded_blocks"])
    del llm
    free_memory()
    return out


def kernel_totals(prof) -> list[list]:
    """[name, total ms, calls] of every kernel a `torch.profiler` run recorded, the largest first; on the CPU (--tiny),
    the operators' own CPU time stands in."""
    on_gpu = torch.cuda.is_available()
    totals: dict[str, list] = {}
    for event in prof.events():
        if on_gpu and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = totals.setdefault(event.name, [event.name, 0.0, 0])
        row[1] += (event.device_time_total if on_gpu else event.self_cpu_time_total) / 1e3
        row[2] += 1
    return sorted((r for r in totals.values() if r[1] > 0), key=lambda r: -r[1])


def print_kernels(name: str, r: dict, top: int = 15) -> None:
    """The `top` kernels of a same-memory run profiled with --profile-kernels: total ms, share, calls, us a call."""
    rows = r.get("kernels") or []
    total = sum(k[1] for k in rows) or 1.0
    print(f"--- {name}: {total / 1e3:.2f} s of kernels in a run of {r['seconds']:.2f} s (under the profiler)")
    for kname, ms, calls in rows[:top]:
        print(f"{ms:10.1f} ms  {100 * ms / total:5.1f}%  {calls:8d} x {1e3 * ms / max(calls, 1):8.1f} us  {kname[:90]}")


def same_memory_title(results: dict, what: str) -> str:
    a = results["args"]
    return (f"the same {a['same_memory']} GiB of {what}: {a['requests']} requests x {a['prompt_tokens']} prompt + "
            f"{a['new_tokens']} new tokens\n{results.get('gpu', '')}, {a['layers']}-layer Llama-3-8B shape, "
            f"{results.get('date', '')}")


def plot_same_memory(results: dict, path: Path) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    runs = results["same_memory"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(runs)
    bars = ax.barh(names, [runs[n]["tokens_per_s"] for n in names], color=[f"C{i}" for i in range(len(names))])
    base = runs[names[0]]["tokens_per_s"]
    ax.bar_label(bars, [f"{runs[n]['tokens_per_s'] / base:.2f}x, {runs[n]['preemptions']} preemptions" for n in names],
                 fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"output tokens/s (labels: x {names[0]}), higher is better")
    ax.set_title(same_memory_title(results, "pages"), fontsize=9)
    plotting.save(fig, path)
    return True


def plot_lookahead(results: dict, path: Path) -> bool:
    """Output tokens/s against the admission lookahead, one line per format (through the median of repeated runs;
    every run a point), for same-memory runs at several lookaheads: where waves (a long lookahead) and recomputed
    preemptions (a short one) cost least."""
    plt = plotting.pyplot()
    points: dict[str, dict[int, list[float]]] = {}
    for r in results["same_memory"].values():
        if not r.get("swap_on_preemption"):
            points.setdefault(r["format"], {}).setdefault(r["admission_lookahead_tokens"], []).append(r["tokens_per_s"])
    if plt is None or not any(len(p) > 1 for p in points.values()):
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (fmt, per) in enumerate(points.items()):
        xs = sorted(per)
        ax.plot(xs, [statistics.median(per[x]) for x in xs], color=f"C{i}", marker="o", label=fmt)
        for x in xs:
            ax.scatter([x] * len(per[x]), per[x], color=f"C{i}", s=10, alpha=0.6)
    ax.set_xlabel("admission_lookahead_tokens")
    ax.set_ylabel("output tokens/s, higher is better")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(same_memory_title(results, "pages") + ", by admission lookahead", fontsize=9)
    plotting.save(fig, path)
    return True


def plot_timelines(results: dict, path: Path) -> bool:
    """Running requests and pages in use against time, one line per same-memory run: where the batch was full,
    where it waited on prefill, and the tail of the last requests."""
    plt = plotting.pyplot()
    runs = {n: r for n, r in results["same_memory"].items() if r.get("timeline", {}).get("rows")}
    if plt is None or not runs:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.6), sharex=True)
    for i, (name, r) in enumerate(runs.items()):
        rows = r["timeline"]["rows"]
        t = [row[0] for row in rows]
        top.plot(t, [row[1] for row in rows], color=f"C{i}", lw=1, label=f"{name}: {r['tokens_per_s']:.0f} tokens/s")
        bottom.plot(t, [row[3] / r["num_blocks"] for row in rows], color=f"C{i}", lw=1)
    top.set_ylabel("running requests")
    top.legend(fontsize=7, loc="upper right")
    bottom.set_ylabel("pages in use (fraction)")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("seconds since the requests arrived")
    top.set_title(same_memory_title(results, "pages over time"), fontsize=9)
    plotting.save(fig, path)
    return True


def plot(results: dict, path: Path) -> bool:
    """Decode tokens/s per batch (log scale; the DynamicCache loop and each format), and the batch workload's
    output tokens/s against generate_batch."""
    plt = plotting.pyplot()
    if plt is None:
        return False
    base = {int(b): v for b, v in results["dynamic_cache"].items()}
    batches = sorted(base)
    series = {"transformers DynamicCache, eager": [base[b] for b in batches]}
    for fmt, per in results.get("pagedkv", {}).items():
        decode = {int(b): r for b, r in per["decode"].items()}
        series[f"pagedkv {fmt}, CUDA graphs"] = [decode[b]["tokens_per_s"] for b in batches]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    bars = plotting.grouped_bars(ax0, [f"batch {b}" for b in batches], series)
    for container, values in list(zip(bars, series.values()))[1:]:
        ax0.bar_label(container, [f"{v / base[b]:.1f}x" for v, b in zip(values, batches)], fontsize=7)
    ax0.set_yscale("log")
    ax0.set_ylabel("decode tokens/s (log), higher is better")
    ax0.legend(fontsize=8)
    args = results.get("args", {})
    ax0.set_title(f"decode, {args.get('context', '?')} tokens of context (labels: x the DynamicCache loop)", fontsize=9)
    runs = {}
    if "tokens_per_s" in results.get("generate_batch", {}):
        runs["transformers\ngenerate_batch"] = results["generate_batch"]["tokens_per_s"]
    for fmt, per in results.get("pagedkv", {}).items():
        runs[f"pagedkv {fmt}\nLLM.generate"] = per["generate"]["tokens_per_s"]
    first = 0 if "tokens_per_s" in results.get("generate_batch", {}) else 1   # colours as in the first panel
    ax1.barh(list(runs), list(runs.values()), color=[f"C{first + i}" for i in range(len(runs))])
    ax1.invert_yaxis()
    ax1.set_xlabel("output tokens/s, higher is better")
    ax1.set_title(f"{args.get('requests', '?')} requests x {args.get('prompt_tokens', '?')} prompt + "
                  f"{args.get('new_tokens', '?')} new tokens", fontsize=9)
    fig.suptitle(f"{results.get('gpu', '')}, {args.get('layers', '?')}-layer Llama-3-8B-shaped bf16, "
                 f"{results.get('date', '')}", fontsize=9)
    plotting.save(fig, path)
    return True


def add_layer_options(p: argparse.ArgumentParser) -> None:
    """Options of this script and bench/engine_profile.py that change how the engine runs a step."""
    p.add_argument("--launch-order", choices=("grid", "longest-first"), default=None,
                   help="decode kernels launch their programs in grid order or longest sequence first; default: "
                        "`pagedkv.ops.metadata.LONGEST_FIRST` (longest first)")
    p.add_argument("--compile-dynamic", choices=("true", "auto"), default=None,
                   help="compiled layers' shapes: every dimension symbolic (true) or the sizes that change (auto); "
                        "default: `pagedkv.hf.COMPILE_OPTIONS`")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="each step planned and queued before the tokens of the one in flight are read (default: "
                        "`EngineConfig`'s, on for CUDA)")


ASYNC_SCHEDULING: bool | None = None   # EngineConfig.async_scheduling of the engines built here (--async-scheduling)


def use_layer_options(args: argparse.Namespace) -> None:
    global ASYNC_SCHEDULING
    ASYNC_SCHEDULING = args.async_scheduling
    if args.launch_order:
        from pagedkv.ops import metadata

        metadata.LONGEST_FIRST = args.launch_order == "longest-first"
    if args.compile_dynamic:
        import pagedkv.hf

        pagedkv.hf.COMPILE_OPTIONS["dynamic"] = True if args.compile_dynamic == "true" else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--baseline-steps", type=int, default=12)
    p.add_argument("--eager-steps", type=int, default=8, help="engine steps with graphs off, at the largest batch")
    p.add_argument("--formats", nargs="+", default=["off", "turboquant"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="every engine's decoder layers compiled with torch.compile (default: the engine's, on with "
                        "CUDA graphs)")
    p.add_argument("--out", default=None, help="folder for engine_gpu.json and engine_gpu.png")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks this script, measures nothing")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw engine_gpu.png next to this JSON")
    p.add_argument("--profile-kernels", action="store_true",
                   help="with --same-memory: each timed run under torch.profiler, its GPU time by kernel printed and "
                        "kept in the JSON (the profiler slows the run; the CUDA graph replays' kernels are there where "
                        "CUPTI records graph nodes: the calls column tells)")
    p.add_argument("--same-memory", type=float, default=None, metavar="GIB",
                   help="only the same-memory run: every format's pages get GIB gibibytes")
    p.add_argument("--admission-lookahead-tokens", type=int, nargs="+", default=[EngineConfig.admission_lookahead_tokens],
                   metavar="N", help="the engine's admission lookahead in the same-memory run (default: the engine's); "
                                     "several values run side by side (0: admit on free blocks alone)")
    p.add_argument("--preemption", nargs="+", choices=("recompute", "swap"), default=["recompute"],
                   help="how the same-memory run's preempted requests come back: recomputed, or swapped to a host tier "
                        "as large as the pages (swap_on_preemption); both: side by side")
    p.add_argument("--free-attention", nargs="+", default=[], metavar="FORMAT",
                   help="same-memory run: these formats also run with attention returning zeros (cache writes kept, the "
                        "same schedule), the bound on what faster attention kernels could give them")
    p.add_argument("--length-spread", type=float, default=0.0, metavar="F",
                   help="same-memory run: each request's prompt and output lengths uniform over their mean x (1 +- F)")
    p.add_argument("--graph-batch-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="same-memory run: the CUDA graph buckets (default: the engine's, every 8 up to 256)")
    p.add_argument("--cuda-graph-mixed-tokens", type=int, default=0, metavar="C",
                   help="same-memory run: steps of decodes and prompt chunks of up to C tokens replay mixed CUDA graphs "
                        "(`EngineConfig.cuda_graph_mixed_tokens`; pair with a small --max-num-batched-tokens)")
    add_layer_options(p)
    p.add_argument("--ordered-tail-waves", type=float, default=None, metavar="W",
                   help="`tuning.ORDERED_TAIL_WAVES` for this run (1.0: longest-first split counts may end just past "
                        "one wave of resident programs, as before session 38)")
    p.add_argument("--fused-prefill", action="store_true",
                   help="prefill chunks over quantized pages through the fused kernels (`tuning.DENSE_PREFILL = False`) "
                        "instead of dense scratch pages")
    args = p.parse_args(argv)
    use_layer_options(args)
    from pagedkv.ops.triton import tuning

    if args.fused_prefill:
        tuning.DENSE_PREFILL = False
    if args.ordered_tail_waves is not None:
        tuning.ORDERED_TAIL_WAVES = args.ordered_tail_waves
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        if "same_memory" not in results:
            return 0 if plot(results, Path(args.replot).with_suffix(".png")) else 1
        path = Path(args.replot)
        plot_timelines(results, path.with_name(path.stem + "_timeline.png"))
        plot_lookahead(results, path.with_name(path.stem + "_lookahead.png"))
        return 0 if plot_same_memory(results, path.with_suffix(".png")) else 1
    global DEVICE
    DEVICE = "cpu" if args.tiny else "cuda"

    import transformers

    results = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "args": vars(args),
               "command": "python bench/engine_gpu.py " + " ".join(sys.argv[1:])}
    t_start = time.perf_counter()
    model = build_model(args.layers, args.tiny)
    print(f"model ready in {time.perf_counter() - t_start:.1f}s", flush=True)
    if args.same_memory is not None:
        return main_same_memory(model, args, results, t_start)

    results["dynamic_cache"] = {}
    for b in args.batches:
        results["dynamic_cache"][b] = dynamic_cache_decode(model, b, args.context, args.baseline_steps)
        print(f"DynamicCache eager, batch {b}: {results['dynamic_cache'][b]:.0f} tok/s", flush=True)

    prompts = random_prompts(args.requests, args.prompt_tokens, model.config.vocab_size, seed=1234)
    if not args.skip_generate_batch:
        try:
            results["generate_batch"] = generate_batch_run(model, prompts, args.new_tokens)
        except Exception as exc:  # report, and still measure the rest
            results["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"generate_batch: {results['generate_batch']}", flush=True)

    max_batch = max(args.batches)
    prefill_steps = prefill_step_count(max_batch, args.context, args.max_num_batched_tokens)
    blocks_per_seq = -(-(args.context + args.decode_steps + args.eager_steps + prefill_steps + 32) // 16)
    num_blocks = max(max_batch, args.requests) * blocks_per_seq + 64
    for fmt in args.formats:
        llm = LLM(model, kv_format=fmt, num_blocks=num_blocks, max_num_seqs=max(max_batch, args.requests),
                  max_num_batched_tokens=args.max_num_batched_tokens, compile_layers=args.compile_layers)
        per = results.setdefault("pagedkv", {}).setdefault(fmt, {"decode": {}})
        for b in args.batches:
            eager = args.eager_steps if b == max_batch else 0
            per["decode"][b] = engine_decode(llm, b, args.context, args.decode_steps, eager_steps=eager,
                                             profile=True)
            print(f"pagedkv {fmt}, batch {b}: {({k: v for k, v in per['decode'][b].items() if k != 'eager_host_ms'})}",
                  flush=True)
        per["generate"] = engine_generate_run(llm, prompts, args.new_tokens)
        print(f"pagedkv {fmt} generate: {per['generate']}", flush=True)
        stats = llm.engine.cache.paged_stats()
        per["kernels"] = {k: stats[k] for k in ("triton_attention_calls", "reference_attention_calls")}
        per["engine_stats"] = llm.stats()
        del llm
        free_memory()
    results["seconds"] = time.perf_counter() - t_start

    print(f"\n{results['gpu']}, torch {results['torch']}, transformers {results['transformers']}, "
          f"{args.layers}-layer Llama-3-8B-shaped bf16, {args.context} tokens of context")
    print("| decode tokens/s | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("| --- |" + " --- |" * len(args.batches))
    print("| transformers DynamicCache, eager | " + " | ".join(f"{results['dynamic_cache'][b]:.0f}" for b in args.batches) + " |")
    for fmt, per in results.get("pagedkv", {}).items():
        cells = [f"{per['decode'][b]['tokens_per_s']:.0f} ({per['decode'][b]['tokens_per_s'] / results['dynamic_cache'][b]:.1f}x)"
                 for b in args.batches]
        print(f"| pagedkv {fmt}, CUDA graphs | " + " | ".join(cells) + " |")
        if "gpu_ms_per_step" in per["decode"][max_batch]:
            print(f"| pagedkv {fmt}: engine step / GPU replay alone (ms) | " + " | ".join(
                f"{per['decode'][b]['ms_per_step']:.2f} / {per['decode'][b].get('gpu_ms_per_step', float('nan')):.2f}"
                for b in args.batches) + " |")
        eager = per["decode"][max_batch].get("eager_tokens_per_s")
        if eager:
            print(f"| pagedkv {fmt}, eager (graphs off) | " + " | ".join(["-"] * (len(args.batches) - 1)) + f" | {eager:.0f} |")
    gb = results.get("generate_batch", {})
    print(f"\n{args.requests} requests x {args.prompt_tokens} prompt tokens + {args.new_tokens} new tokens: output tokens/s")
    if "tokens_per_s" in gb:
        print(f"| transformers generate_batch | {gb['tokens_per_s']:.0f} | {gb['seconds']:.2f} s |")
    for fmt, per in results.get("pagedkv", {}).items():
        g = per["generate"]
        ratio = f" ({g['tokens_per_s'] / gb['tokens_per_s']:.1f}x)" if "tokens_per_s" in gb else ""
        print(f"| pagedkv {fmt} LLM.generate | {g['tokens_per_s']:.0f}{ratio} | {g['seconds']:.2f} s |")
    for fmt, per in results.get("pagedkv", {}).items():
        print(f"GPU time of one decode step at batch {max_batch} by kernel group, {fmt}: "
              f"{per['decode'][max_batch].get('gpu_ms_by_kernel_group')}")
        host = per["decode"][max_batch].get("eager_host_ms")
        if host:
            top = ", ".join(f"{k} {v['ms_per_step']:.2f}" for k, v in list(host["own_time"].items())[:8])
            print(f"host time of one eager step at batch {max_batch}, {fmt}: {host['ms_per_step']:.1f} ms; most: {top}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "engine_gpu.json").write_text(json.dumps(results, indent=2, default=str))
        plot(json.loads(json.dumps(results, default=str)), Path(args.out) / "engine_gpu.png")
    print(f"total {results['seconds']:.0f}s")
    return 0


def main_same_memory(model, args, results: dict, t_start: float) -> int:
    # --length-spread: prompt lengths and output lengths spread around their means (the batches' sequences then
    # differ in length, as a server's do); 0: every request alike
    lengths = spread_lengths(args.requests, args.prompt_tokens, args.length_spread, seed=1234)
    prompts = ragged_prompts(lengths, model.config.vocab_size, seed=1234)
    new_tokens = spread_lengths(args.requests, args.new_tokens, args.length_spread, seed=4321)
    budget = int(args.same_memory * 2**30)
    results["same_memory"] = {}
    lookaheads, modes = args.admission_lookahead_tokens, args.preemption
    for fmt in args.formats:
        for lookahead in lookaheads:  # several: side by side, each run named "format, lookahead N[, swap]"
            for mode in modes:
                for free in (False, True) if fmt in args.free_attention else (False,):
                    with attention_free() if free else contextlib.nullcontext():
                        r = same_memory_run(model, fmt, budget, prompts, new_tokens, args.max_num_batched_tokens,
                                            lookahead, swap=mode == "swap", compile_layers=args.compile_layers,
                                            graph_batch_sizes=args.graph_batch_sizes,
                                            profile_kernels=args.profile_kernels,
                                            mixed_graph_tokens=args.cuda_graph_mixed_tokens)
                    name = (fmt + (f", lookahead {lookahead}" if len(lookaheads) > 1 else "")
                            + (f", {mode}" if len(modes) > 1 else "") + (", attention free" if free else ""))
                    results["same_memory"][name] = r
                    print(f"pagedkv {name}, {args.same_memory} GiB of pages, admission lookahead {lookahead}, preemption "
                          f"by {mode}: {({k: v for k, v in r.items() if k not in ('timeline', 'kernels')})}", flush=True)
                    if "kernels" in r:
                        print_kernels(name, r)
    results["seconds"] = time.perf_counter() - t_start
    print(f"\n{results['gpu']}: the same {args.same_memory} GiB of pages, {args.requests} requests x "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens (EOS ignored), {args.layers} layers")
    print("| run | tokens that fit | output tokens/s | vs first | preemptions | steps (graph replays) | output tokens / step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    runs = results["same_memory"]
    base = next(iter(runs.values()))["tokens_per_s"]

    def swapped(r):
        return f" ({r['blocks_swapped_in']} blocks back from the host)" if r.get("swap_on_preemption") else ""

    for name, r in runs.items():
        print(f"| {name} | {r['tokens_that_fit']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['preemptions']}{swapped(r)} | {r['steps']} ({r['cuda_graph_replays']}) | {r['mean_batch']:.1f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "engine_memory.json").write_text(json.dumps(results, indent=2, default=str))
        plain = json.loads(json.dumps(results, default=str))
        plot_same_memory(plain, Path(args.out) / "engine_memory.png")
        plot_timelines(plain, Path(args.out) / "engine_memory_timeline.png")
        plot_lookahead(plain, Path(args.out) / "engine_memory_lookahead.png")
    print(f"total {results['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
