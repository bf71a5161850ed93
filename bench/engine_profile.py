"""Where an eager engine step's time goes on a GPU: a Python profile (cProfile) of a few engine steps
with CUDA graphs off, for each page format, on the Llama-3-8B-shaped model of `bench/engine_gpu.py`.

Two kinds of step are profiled: a mixed prefill step (`--requests` prompts of `--prompt-tokens`, as
in the batch workload) and, once every request is prefilled, pure decode steps run eagerly. Prints
the steps' wall times and the functions with the most own time. `--kernels` profiles the decode steps with
`torch.profiler` instead (the first prefill step, then decode steps): device time per step by kernel, and the
kernels' total, per format.

    python bench/engine_profile.py --formats off turboquant
    python bench/engine_profile.py --formats off q4 turboquant --requests 128 --prompt-tokens 1536 --kernels
    python bench/engine_profile.py --formats q4 --kernels --no-compile-layers   # decoder layers eager
    python bench/engine_profile.py --formats q4 --requests 16 --kernels --trace bench/results/h200   # + GPU idle

`--trace DIR` also traces an eager decode step and a mixed step (one new prompt beside the decodes) under
`torch.profiler` with the host's Python stack (DIR/decode_step_trace_FORMAT.json.gz, mixed_step_trace_...), and one
more prefill step of new prompts (DIR/prefill_step_trace_FORMAT.json.gz), printing where the GPU waited in each
(`bench/trace_gaps.py`), and runs another with `torch.cuda.set_sync_debug_mode("warn")`: every call that makes the
host wait for the GPU inside a step is printed with its line. `--plain-steps N` times N eager decode steps and N
mixed ones with no profiler at all (what an engine without CUDA graphs for such steps pays).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_gpu  # noqa: E402
from engine_gpu import build_model, random_prompts, sync  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402


def profiled(fn, n: int, top: int, label: str) -> float:
    sync()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(n):
        fn()
    sync()
    prof.disable()
    ms = (time.perf_counter() - start) / n * 1e3
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()][-top - 1:]
    print(f"--- {label}: {ms:.1f} ms per step (under cProfile)\n" + "\n".join(lines), flush=True)
    return ms


def kernel_times(fn, n: int, top: int, label: str) -> float:
    """Device time per call of `fn` by kernel (`torch.profiler`, `engine_gpu.kernel_totals`), the `top` largest
    printed, beside the calls' wall time (under the profiler: the gap is what the GPU waits for the host, plus the
    profiler's own cost); returns the total (us per call)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()   # on the CPU (--tiny) the operators' CPU time stands in
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        wall_us = (time.perf_counter() - start) / n * 1e6
    times = [(name, 1e3 * ms / n) for name, ms, _ in engine_gpu.kernel_totals(prof)]
    total = sum(us for _, us in times)
    print(f"--- {label}: {total:.0f} us of {'kernels' if on_gpu else 'CPU operators'} per step, {wall_us:.0f} us wall")
    for name, us in times[:top]:
        print(f"{us:9.1f} us  {100 * us / total:5.1f}%  {name[:110]}")
    return total


def plain_steps(engine, n: int, fmt: str, batch: int, mixed: list | None = None, params=None) -> None:
    """Wall time of `n` eager engine steps one at a time, no profiler (each waits for the GPU): decode steps of the
    running requests, or with `mixed` (n prompts) steps that each admit one of them beside the decodes. Prints the
    median and the range (ms)."""
    import statistics

    times, rids = [], []
    for i in range(n):
        if mixed is not None:
            rids.append(engine.add_request(mixed[i], params))
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    kind = "mixed step (one prompt admitted beside the decodes)" if mixed is not None else "decode step"
    print(f"--- {fmt}: eager {kind}, batch ~{batch}, no profiler: median {statistics.median(times):.2f} ms "
          f"(min {min(times):.2f}, max {max(times):.2f}, {n} steps)", flush=True)
    for r in rids:
        engine.abort(r)


def trace_step(fn, path: Path, top: int) -> None:
    """One call of `fn` under torch.profiler (CPU and CUDA, Python stacks), its chrome trace written to `path`
    (gzip), then its GPU idle stretches printed."""
    import gzip
    import shutil

    import trace_gaps
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3
    plain = path.with_suffix("")   # .json
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
    print(f"--- traced step: {wall_ms:.1f} ms wall under the profiler, trace in {path}", flush=True)
    if torch.cuda.is_available():
        trace_gaps.main([str(path), "--top", str(top)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--formats", nargs="+", default=["off", "turboquant"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks this script, measures nothing")
    p.add_argument("--kernels", action="store_true", help="device time by kernel of the steps (torch.profiler)")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="also trace an eager decode step, a mixed step and one more prefill step (chrome traces into "
                        "DIR, GPU idle stretches printed) and run another with CUDA sync debugging on")
    p.add_argument("--plain-steps", type=int, default=0, metavar="N",
                   help="also time N eager decode steps and N eager mixed steps (one new prompt each) without a profiler")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="the decoder layers compiled with torch.compile (default: EngineConfig's, on with CUDA graphs)")
    engine_gpu.add_layer_options(p)
    args = p.parse_args(argv)
    engine_gpu.use_layer_options(args)
    if args.tiny:
        engine_gpu.DEVICE = "cpu"
    measure = kernel_times if args.kernels else profiled
    model = build_model(args.layers, args.tiny)
    prompts = random_prompts(args.requests, args.prompt_tokens, model.config.vocab_size, seed=1234)
    # to compile each format's kernels outside the profile: other prompts, since the measured ones would hit the
    # prefix cache and the profiled prefill step compute fewer tokens than it says; as many as the measured ones, so
    # that the compiled layers' first (static) graph has the measured prefill step's shape and their dynamic one is
    # recompiled at a decode batch of --requests, as in a served engine (inductor sizes its launch configs for the
    # shape it recompiles at: after a 2-token decode the SiLU-times-up of a 16,384-token step took 8.9 ms, H200)
    warm_up = random_prompts(args.requests, args.prompt_tokens, model.config.vocab_size, seed=4321)
    for fmt in args.formats:
        llm = LLM(model, kv_format=fmt, num_blocks=args.requests * (args.prompt_tokens // 16 + 8) + 64,
                  max_num_seqs=args.requests, max_num_batched_tokens=args.max_num_batched_tokens,
                  compile_layers=args.compile_layers,
                  # one step at a time (a step queued behind the profiled one would run inside its profile)
                  async_scheduling=bool(engine_gpu.ASYNC_SCHEDULING))
        engine = llm.engine
        engine.runner.graphs = None
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        for prompt in warm_up:
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        rids = [engine.add_request(prompt, params) for prompt in prompts]
        seqs = [engine.requests[r] for r in rids]
        measure(engine.step, 1, args.top, f"{fmt}: first prefill step ({args.max_num_batched_tokens} tokens)")
        while any(s.num_output_tokens == 0 for s in seqs):
            engine.step()
        if args.kernels:
            engine.step()   # the first step that decodes every request runs outside the profile
        measure(engine.step, 4, args.top, f"{fmt}: eager decode step, batch {args.requests}, "
                f"{args.prompt_tokens} tokens of context")
        if args.plain_steps:
            plain_steps(engine, args.plain_steps, fmt, args.requests)
            plain_steps(engine, args.plain_steps, fmt, args.requests,
                        mixed=random_prompts(args.plain_steps, args.prompt_tokens, model.config.vocab_size, seed=55),
                        params=params)
        if args.trace is not None:
            args.trace.mkdir(parents=True, exist_ok=True)
            trace_step(engine.step, args.trace / f"decode_step_trace_{fmt}.json.gz", args.top)
            extra = random_prompts(1, args.prompt_tokens, model.config.vocab_size, seed=66)
            rids.append(engine.add_request(extra[0], params))
            trace_step(engine.step, args.trace / f"mixed_step_trace_{fmt}.json.gz", args.top)
        for r in rids:
            engine.abort(r)
        while engine.has_unfinished():
            engine.step()
        if args.trace is not None:
            args.trace.mkdir(parents=True, exist_ok=True)
            fresh = random_prompts(2 * args.requests, args.prompt_tokens, model.config.vocab_size, seed=777)
            rids = [engine.add_request(prompt, params) for prompt in fresh[:args.requests]]
            trace_step(engine.step, args.trace / f"prefill_step_trace_{fmt}.json.gz", args.top)
            rids += [engine.add_request(prompt, params) for prompt in fresh[args.requests:]]
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            try:
                start = time.perf_counter()
                engine.step()
                sync()
                print(f"--- a prefill step under sync debugging: {(time.perf_counter() - start) * 1e3:.1f} ms",
                      flush=True)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode(0)
            for r in rids:
                engine.abort(r)
        del llm, engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
