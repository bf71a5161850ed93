"""The `pagedkv` command: `generate` (and the subcommands other modules register in `COMMANDS`)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import PagedKVError

DEFAULT_PROMPT = "Explain in two sentences why a paged key/value cache saves memory."


def add_cache_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("paged KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per page block (default 16)")
    g.add_argument("--num-blocks", type=int, default=1024, help="blocks in the pool (default 1024)")
    g.add_argument("--dynamic", action="store_true", default=None,
                   help="grow the pool geometrically, capped by the context window (env PAGEDKV_DYNAMIC)")
    g.add_argument("--context-window-tokens", type=int, default=None,
                   help="growth cap per sequence (default: the model's max_position_embeddings)")
    g.add_argument("--paged-kv-quantization", default="off", metavar="FORMAT",
                   help="page format: off, q8, q6, q4, turboquant, turboquant:k=q4_0,v=q3_0[,rotate_keys]")
    g.add_argument("--boundary-layers", type=int, default=0,
                   help="keep the first and last N layers dense when quantizing (default 0)")
    g.add_argument("--kernels", choices=("auto", "triton", "reference"), default=None,
                   help="attention kernels (env PAGEDKV_KERNELS; default auto)")


def cache_options(args: argparse.Namespace) -> dict:
    """Validated `PagedKVCache` options from the parsed flags (raises ConfigError on bad values)."""
    from .config import CacheConfig

    opts = dict(block_size=args.block_size, num_blocks=args.num_blocks, dynamic=args.dynamic,
                context_window_tokens=args.context_window_tokens, kv_format=args.paged_kv_quantization,
                boundary_layers=args.boundary_layers, kernels=args.kernels)
    CacheConfig.build(**opts)  # validate before loading a model
    return opts


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", default=None, metavar="SPEC",
                   help="draft tokens and verify them in one forward: 'ngram' (prompt lookup), 'ngram:min=2,max=4', "
                        "'draft:model=PATH' (a smaller model with the same tokenizer; layers=N keeps its first N "
                        "layers); default off")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step at most (default 4; adaptive per request)")


def speculative_options(args: argparse.Namespace):
    """The validated `SpeculativeConfig` of --speculative / --num-speculative-tokens, or None (off)."""
    from .engine.spec import SpeculativeConfig
    from .errors import ConfigError

    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise ConfigError("--num-speculative-tokens needs --speculative (e.g. --speculative ngram)")
        return None
    config = SpeculativeConfig.build(args.speculative)
    if args.num_speculative_tokens is not None:
        config = SpeculativeConfig(**{**config.__dict__, "num_speculative_tokens": args.num_speculative_tokens})
    return config


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a transformers folder, or a .gguf file")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model dtype: fp32, bf16, fp16 (default fp32 on CPU, bf16 on CUDA)")


def resolve_device_dtype(args):
    import torch

    from .config import parse_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(args.dtype, "--dtype") or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return device, dtype


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


def generate_text(model, tokenizer, cache, prompt: str, args: argparse.Namespace) -> int:
    """Stream the answer to `prompt` from `model` over `cache` (sampling and stats options from `args`)."""
    import torch

    from .errors import CacheCapacityError, ContextWindowError
    from .hf import cache_kwarg

    device = model.device
    use_chat = args.chat and getattr(tokenizer, "chat_template", None)
    if use_chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    ids = ids.to(device)
    window = getattr(model.config, "max_position_embeddings", None)
    if window and ids.shape[1] + args.max_new_tokens > window:
        raise ContextWindowError(f"the prompt has {ids.shape[1]} tokens and --max-new-tokens is {args.max_new_tokens}, "
                                 f"more than the model's context window of {window} tokens; shorten the prompt or "
                                 "lower --max-new-tokens")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    sampling = dict(do_sample=args.temperature > 0)
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_p=args.top_p, top_k=0)
    limit = cache_limit(cache)
    if limit is not None and ids.shape[1] > limit[0]:
        raise ContextWindowError(f"the prompt has {ids.shape[1]} tokens, more than the {limit[0]} the KV cache holds "
                                 f"({limit[1]}); shorten the prompt or {limit[2]}")
    streamer = _counting_streamer(tokenizer)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                           streamer=streamer, pad_token_id=tokenizer.pad_token_id, **sampling,
                           **{cache_kwarg(model): cache})
    except CacheCapacityError:  # the cache is full: an ordinary end, like --max-new-tokens (cache left as it was)
        if limit is None:
            raise
        streamer.end()
        say_cache_full(streamer.num_new_tokens, limit)
    elapsed = time.perf_counter() - start
    new_tokens = streamer.num_new_tokens
    if args.stats:
        stats = cache.paged_stats()
        stats.update(prompt_tokens=ids.shape[1], new_tokens=new_tokens, seconds=round(elapsed, 3),
                     tokens_per_s=round(new_tokens / elapsed, 2))
        print(json.dumps(stats, indent=2, default=str), file=sys.stderr)
    return 0


def cache_limit(cache) -> tuple[int, str, str] | None:
    """(tokens one sequence can hold, the setting that caps them, how to raise it), or None when unbounded."""
    cfg = cache.config
    if cfg.dynamic:
        if cfg.context_window_tokens is None:
            return None
        return (cfg.context_window_tokens, f"context_window_tokens={cfg.context_window_tokens}",
                "raise --context-window-tokens (env PAGEDKV_CONTEXT_WINDOW_TOKENS)")
    return (cache.num_blocks * cfg.block_size, f"num_blocks={cache.num_blocks} of {cfg.block_size} tokens, no growth",
            "raise --num-blocks or add --dynamic")


def say_cache_full(num_new_tokens: int, limit: tuple[int, str, str]) -> None:
    """The one stderr line of a generation that ended because the KV cache was full (`cache_limit`)."""
    print(f"pagedkv: stopped after {num_new_tokens} new tokens: the KV cache is full at {limit[0]} tokens "
          f"({limit[1]}); {limit[2]} to generate more", file=sys.stderr)


def _counting_streamer(tokenizer):
    """transformers' TextStreamer over `tokenizer` (prompt skipped) that also counts the new tokens it is given."""
    from transformers import TextStreamer

    class CountingStreamer(TextStreamer):
        num_new_tokens = 0

        def put(self, value):
            if not (self.skip_prompt and self.next_tokens_are_prompt):
                self.num_new_tokens += value.numel()
            super().put(value)

    return CountingStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


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
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model's heads over N ranks (GPUs with NCCL, CPU processes with gloo; default 1)")
    add_cache_options(g)
    add_speculative_options(g)
    g.set_defaults(func=cmd_generate)
    for register in _subcommand_registrars():
        register(sub)
    return parser


def _subcommand_registrars():
    """Other modules' subcommands (eval, serve), each `register(subparsers)`; missing ones are skipped."""
    import importlib

    out = []
    for module in ("pagedkv.evaluate", "pagedkv.engine.server"):
        try:
            out.append(importlib.import_module(module).register_cli)
        except ImportError as exc:
            if getattr(exc, "name", None) not in (module, None) and not str(exc).startswith("No module named 'pagedkv"):
                raise
    return out


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
