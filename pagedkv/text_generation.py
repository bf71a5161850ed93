"""One prompt through transformers `generate` over a paged cache, streamed to stdout (`pagedkv generate`, on one
process or on rank 0 of a tensor-parallel run), and the line it prints when the cache fills up."""

from __future__ import annotations

import argparse
import json
import sys
import time


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
