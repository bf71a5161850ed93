"""transformers integration: the "pagedkv" attention implementation and `install_paged_kv_cache`.

A switched model plans each forward once (a forward pre-hook on its decoder reads the batch shape and
the 2-D padding mask and calls `PagedKVCache.begin_forward`); every attention layer then writes its new
keys/values through `cache.update` and attends over the pages through `paged_attention_forward`, which
finds the cache in the layer's keyword arguments. The layer never sees a contiguous copy of the cache.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cache import PagedKVCache
from .errors import ConfigError

ATTN_IMPLEMENTATION = "pagedkv"
_CACHE_KWARG = "pagedkv_cache"
# set by `compile_layers`: the cache's writes and attention are opaque to torch.compile
_opaque_to_compiler = False
# torch.compile's options for `compile_layers`. dynamic=True makes every input dimension symbolic, the model's own
# (head_dim, from the rotary cos/sin) included; dynamic=None (automatic) compiles the first shape static and then
# only the sizes that changed (a step's tokens) dynamic, so the kernels index by constant head and hidden sizes:
# the default (H200: the rotary kernel a quarter of its time, a prefill step 2% and the same-memory run 1-3% faster).
COMPILE_OPTIONS = {"dynamic": None}


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers attention function. query: [batch, num_q_heads, T, head_dim] -> ([batch, T, num_q_heads, head_dim], None)."""
    cache: PagedKVCache | None = kwargs.pop(_CACHE_KWARG, None)
    if cache is None or cache.plan is None:
        # another cache (or none): the keys/values are dense, so attend with transformers' SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    batch, num_heads, num_cols, head_dim = query.shape
    scale = scaling if scaling is not None else head_dim ** -0.5
    plan = cache.plan
    q = query.transpose(1, 2).reshape(batch * num_cols, num_heads, head_dim)  # [B*T, Hq, D]
    if plan.token_index is not None:
        q = q.index_select(0, plan.token_index)
    window = sliding_window if sliding_window else None
    out = cache.attention(module.layer_idx, q, scale=scale, sliding_window=window, softcap=softcap or None)
    if plan.token_index is not None:
        full = out.new_zeros(batch * num_cols, num_heads, out.shape[-1])
        full.index_copy_(0, plan.token_index, out)
        out = full
    return out.view(batch, num_cols, num_heads, -1), None


def register() -> None:
    """Register the "pagedkv" attention implementation with transformers (idempotent)."""
    attention = torch.compiler.disable(paged_attention_forward) if _opaque_to_compiler else paged_attention_forward
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    # masks are built as for SDPA: the paged path ignores them (the plan knows the layout), while a switched
    # model that is handed another cache attends densely and needs them
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword this transformers release uses for the cache: `cache` (newer) or `past_key_values` (5.17)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if decoder is not None else model


def _find_cache(args, kwargs) -> PagedKVCache | None:
    for name in ("cache", "past_key_values"):
        if isinstance(kwargs.get(name), PagedKVCache):
            return kwargs[name]
    return None


def _pre_forward(module, args, kwargs):
    cache = _find_cache(args, kwargs)
    if cache is None:
        return None
    if cache.plan is None:  # the engine plans its own steps; plain transformers calls are planned here
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = input_ids if input_ids is not None else embeds
        batch, num_cols = ref.shape[0], ref.shape[1]
        cache.begin_forward(batch, num_cols, kwargs.get("attention_mask"), ref.device)
        cache.planned_by_model = True
    kwargs[_CACHE_KWARG] = cache
    return args, kwargs


def _post_forward(module, args, kwargs, output):
    cache = kwargs.get(_CACHE_KWARG)
    if cache is not None and cache.planned_by_model:
        cache.planned_by_model = False
        cache.end_forward()
    return None


def switch_model(model: torch.nn.Module) -> None:
    """Route `model`'s attention through pagedkv (idempotent)."""
    register()
    if not hasattr(model, "set_attn_implementation"):
        raise ConfigError(f"{type(model).__name__} is not a transformers model with a switchable attention implementation")
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if getattr(model, "_pagedkv_switched", False):
        return
    decoder = _decoder(model)
    decoder.register_forward_pre_hook(_pre_forward, with_kwargs=True, prepend=True)
    decoder.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    model._pagedkv_switched = True


def compile_layers(model: torch.nn.Module, **options) -> int:
    """Compile each decoder layer of `model` in place with torch.compile (`nn.Module.compile`; `COMPILE_OPTIONS`
    unless `options` say otherwise) and return how many. The paged cache's writes (`PagedKVCache.update`) and attention
    stay outside the compiled graphs, called from them as opaque functions (marked once per process), so what lies
    between them fuses (norms, rotary embeddings, activations, residual adds) while the cache's kernels run as
    before. A layer's index is not specialized on (`allow_unspec_int_on_nn_module`), so the layers share their
    compiled graphs. The first steps of each new shape compile (seconds per graph)."""
    global _opaque_to_compiler
    layers = getattr(_decoder(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ConfigError(f"{type(model).__name__} has no decoder layers to compile (expected model.model.layers)")
    if not _opaque_to_compiler:   # once per process
        _opaque_to_compiler = True
        PagedKVCache.update = torch.compiler.disable(PagedKVCache.update)
        register()
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
    for layer in layers:
        layer.compile(**{**COMPILE_OPTIONS, **options})
    return len(layers)


def text_config(config):
    """The language model's part of a transformers config (multimodal configs nest it), else `config`."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def install_paged_kv_cache(model: torch.nn.Module, *, model_id: str | None = None, **cache_options) -> PagedKVCache:
    """Switch `model` to the "pagedkv" attention and return a fresh `PagedKVCache` for it.

    `cache_options` are `PagedKVCache` options (block_size, num_blocks, dynamic, kv_format, ...). The
    model's layer count and context window (max_position_embeddings) fill in unset options. The cache
    records the model's identity (`pagedkv.identity.model_identity`: architecture, shapes, a weights
    fingerprint, and `model_id` when given) for the headers of the files it saves.
    """
    switch_model(model)
    text = text_config(getattr(model, "config", None))
    cache_options.setdefault("num_layers", getattr(text, "num_hidden_layers", None))
    if cache_options.get("context_window_tokens") is None:
        from .config import env_defaults

        env_ctx = env_defaults()["context_window_tokens"]
        cache_options["context_window_tokens"] = env_ctx or getattr(text, "max_position_embeddings", None)
    from .identity import model_identity

    return PagedKVCache(model_identity=model_identity(model, model_id), **cache_options)
