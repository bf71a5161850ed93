"""The `pagedkv` command: `generate`, `serve`, and `eval` (which `pagedkv.evaluate` registers).

The options the commands share, and their parsing, live in `pagedkv.options`, below every command."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import PagedKVError
from .evaluate import register_cli as register_eval
from .options import (add_cache_options, add_model_options, add_speculative_options, add_tensor_parallel_option,
                      cache_options, resolve_device_dtype, speculative_options)
from .text_generation import cache_limit, generate_text, say_cache_full

DEFAULT_PROMPT = "Explain in two sentences why a paged key/value cache saves memory."


def cmd_generate(args: argparse.Namespace) -> int:
    from . import install_paged_kv_cache, load_model
    from .errors import ConfigError

    if args.max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be a positive number of tokens")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0 means greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    opts = cache_options(args)
    prompt = args.prompt if args.prompt is not None else (sys.stdin.read() if not sys.stdin.isatty() else DEFAULT_PROMPT)
    if not prompt.strip():
        raise ConfigError("the prompt is empty: pass it as an argument or on stdin")
    speculative = speculative_options(args)
    if speculative is not None:
        if args.tensor_parallel != 1:
            raise ConfigError("--speculative is not supported with --tensor-parallel; drop one of them")
        return generate_speculative(args, prompt, opts, speculative)
    if args.tensor_parallel != 1:
        from .parallel.commands import generate_tensor_parallel

        return generate_tensor_parallel(args, prompt, opts)
    device, dtype = resolve_device_dtype(args)
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    return generate_text(model, tokenizer, install_paged_kv_cache(model, **opts), prompt, args)


def generate_speculative(args: argparse.Namespace, prompt: str, opts: dict, speculative) -> int:
    """Stream the answer to `prompt` through the engine with speculative decoding (--stats adds acceptance)."""
    from .engine import LLM, SamplingParams

    device, dtype = resolve_device_dtype(args)
    llm = LLM(args.model, device=device, dtype=dtype, speculative=speculative, **opts)
    ids = llm.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat and getattr(
        llm.tokenizer, "chat_template", None) else prompt
    engine = llm.engine
    if isinstance(ids, str):
        ids = llm.tokenizer(ids).input_ids
    max_tokens, limit = args.max_new_tokens, cache_limit(engine.cache)
    is_capped = limit is not None and len(ids) <= limit[0] < len(ids) + max_tokens - 1
    if is_capped:  # the last token is never written: the cache holds prompt + new tokens - 1
        max_tokens = limit[0] - len(ids) + 1
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=max_tokens)
    request_id = engine.add_request(ids, params, stream=True)
    start, shown, out = time.perf_counter(), 0, None
    while engine.has_unfinished():
        for out in engine.step():
            print(out.text[shown:], end="", flush=True)
            shown = len(out.text)
    print()
    if is_capped and out.outputs[0].finish_reason == "length":
        say_cache_full(len(out.token_ids), limit)
    elapsed = time.perf_counter() - start
    if args.stats:
        stats = engine.cache.paged_stats()
        stats.update({k: v for k, v in engine.stats().items() if k.startswith("spec_")})
        stats.update(request_id=request_id, prompt_tokens=len(out.prompt_token_ids), new_tokens=len(out.token_ids),
                     seconds=round(elapsed, 3), tokens_per_s=round(len(out.token_ids) / elapsed, 2),
                     accepted_tokens_per_step=round(out.metrics.accepted_tokens_per_step, 3))
        print(json.dumps(stats, indent=2, default=str), file=sys.stderr)
    return 0


def register_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="model name clients pass in 'model' (repeatable; default: the --model value)")
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per forward pass: decodes plus prefill chunks (default 2048)")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share cached blocks between requests with a common prefix (default on)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context window)")
    g.add_argument("--enforce-eager", action="store_true", help="never replay CUDA graphs")
    g.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each decoder layer with torch.compile, the cache's kernels as they are "
                        "(default: on with CUDA graphs, i.e. on CUDA without --enforce-eager or --tensor-parallel)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan and queue each step before reading the tokens of the one in flight, so the host's "
                        "work overlaps the GPU's (default: on CUDA, without --tensor-parallel)")
    g.add_argument("--cuda-graph-mixed-tokens", type=int, default=0, metavar="N",
                   help="steps of decodes and prompt chunks of at most N tokens replay CUDA graphs too; pair with "
                        "--max-num-batched-tokens N (default 0: such steps run eagerly)")
    g.add_argument("--cpu-cache-gb", type=float, default=0.0, metavar="GB",
                   help="host memory for prefix-cache blocks evicted from the device pool (default 0: off)")
    g.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="keep prefix-cache blocks in files under DIR, across restarts (default: off)")
    g.add_argument("--disk-cache-gb", type=float, default=16.0, metavar="GB",
                   help="size cap of --kv-cache-dir, least recently used blocks out (default 16)")
    g.add_argument("--swap-on-preemption", action="store_true",
                   help="swap a preempted request's blocks to the host tier instead of recomputing them")
    add_tensor_parallel_option(g)
    g.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_cache_options(p)
    add_speculative_options(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from .engine.config import EngineConfig
    from .errors import ConfigError

    try:
        import uvicorn
    except ImportError:
        raise ConfigError("`pagedkv serve` needs FastAPI and uvicorn: pip install 'pagedkv[serve]'") from None
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: must be between 1 and 65535")
    opts = cache_options(args)
    engine_opts = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       prefix_caching=args.prefix_caching, enforce_eager=args.enforce_eager,
                       max_model_len=args.max_model_len, cpu_cache_gb=args.cpu_cache_gb,
                       kv_cache_dir=args.kv_cache_dir, disk_cache_gb=args.disk_cache_gb,
                       swap_on_preemption=args.swap_on_preemption, compile_layers=args.compile_layers,
                       async_scheduling=args.async_scheduling, cuda_graph_mixed_tokens=args.cuda_graph_mixed_tokens)
    EngineConfig(**engine_opts)  # validate before loading a model
    speculative = speculative_options(args)
    if args.tensor_parallel != 1 and speculative is not None:
        raise ConfigError("--speculative is not supported with --tensor-parallel; drop one of them")
    if args.tensor_parallel != 1 and (args.cpu_cache_gb or args.kv_cache_dir):
        raise ConfigError("--cpu-cache-gb / --kv-cache-dir are not supported with --tensor-parallel; drop one of them")
    if args.tensor_parallel != 1:
        from .parallel.commands import serve_tensor_parallel

        return serve_tensor_parallel(args, opts, engine_opts)
    from .engine.llm import LLM
    from .engine.server import serve

    device, dtype = resolve_device_dtype(args)
    return serve(LLM(args.model, device=device, dtype=dtype, speculative=speculative, **engine_opts, **opts), args,
                 device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="Paged, quantized KV cache for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with the paged KV cache, streaming tokens to stdout")
    g.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_options(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the tokenizer's chat template (default on)")
    g.add_argument("--stats", action="store_true", help="print paged_stats() as JSON on stderr at the end")
    add_tensor_parallel_option(g)
    add_cache_options(g)
    add_speculative_options(g)
    g.set_defaults(func=cmd_generate)
    register_eval(sub)
    register_serve(sub)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"{message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.showwarning = _show_warning
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except PagedKVError as exc:
        print(f"pagedkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
