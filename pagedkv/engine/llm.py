"""`LLM`: offline batched generation, `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..models import load_model
from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "prefix_caching", "enforce_eager",
                  "cuda_graph_batch_sizes", "max_model_len", "cpu_cache_gb", "kv_cache_dir", "disk_cache_gb",
                  "swap_on_preemption", "admission_lookahead_tokens", "compile_layers", "async_scheduling",
                  "cuda_graph_mixed_tokens")


class LLM:
    """A model served by the paged-KV engine.

    model: "default" (SmolLM2-135M-Instruct), a transformers folder, a .gguf file, or a loaded transformers
    model (then pass its `tokenizer`, or give prompts as token ids). device / dtype: where and how a model
    named by path is loaded (default: cuda + bf16 when available, else cpu + fp32). Engine options:
    max_num_seqs, max_num_batched_tokens, prefix_caching, enforce_eager, cuda_graph_batch_sizes,
    max_model_len, compile_layers, async_scheduling, cuda_graph_mixed_tokens, and the prefix cache's tiers cpu_cache_gb, kv_cache_dir, disk_cache_gb,
    swap_on_preemption (see `EngineConfig`). Every other keyword is a `PagedKVCache` option (block_size,
    num_blocks, dynamic, kv_format, kernels, ...), unless `cache` gives a ready cache for a loaded `model`.
    speculative: speculative decoding, e.g. "ngram", "ngram:k=6", "draft:model=default,layers=8", a dict of
    `SpeculativeConfig` fields or a SpeculativeConfig (None: off).
    """

    def __init__(self, model="default", *, tokenizer=None, device: str | None = None, dtype=None, cache=None,
                 speculative=None, **options):
        engine_options = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
        if cache is not None and options:
            raise ConfigError(f"pass either a ready cache or cache options ({', '.join(sorted(options))}), not both")
        config = EngineConfig(**engine_options)
        if isinstance(model, torch.nn.Module):
            model_obj = model
        else:
            from ..config import parse_dtype

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = parse_dtype(dtype, "dtype") or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
            model_obj, loaded_tokenizer = load_model(model, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self.engine = LLMEngine(model_obj, tokenizer, config, options, cache=cache, speculative=speculative)
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # validate all first
        for seq in seqs:
            self.engine.add(seq)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[s.request_id] for s in seqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("this model's tokenizer has no chat template: use completions with a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def stats(self) -> dict:
        return self.engine.stats()
