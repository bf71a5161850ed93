"""The engine's prefix cache: plain (`pagedkv.prefix`), or tiered over host memory and disk (`pagedkv.tiers`)."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..hf import text_config
from ..prefix import PrefixCache
from .config import EngineConfig


def make_prefix_cache(cache, config: EngineConfig, model: torch.nn.Module, *, own_cache: bool) -> PrefixCache:
    """A `TieredPrefixCache` when `config` asks for a host or disk tier, else a `PrefixCache`.

    The tiers address blocks by a hash seeded with the cache's identity, so the cache's layers are
    created here, from the model's shapes, before the first forward pass.
    """
    if not config.has_tiers:
        return PrefixCache(cache, enabled=config.prefix_caching)
    if not own_cache:
        raise ConfigError("cpu_cache_gb / kv_cache_dir need the engine's own cache; they are not supported with a "
                          "ready (tensor-parallel) cache")
    from ..tiers import TieredPrefixCache, TierSettings

    text = text_config(model.config)
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    param = next(model.parameters())
    if not cache.formats or any(f is None for f in cache.formats):
        cache.init_layers(cache.config.num_layers or text.num_hidden_layers, num_kv_heads, head_dim, param.dtype,
                          param.device)
    return TieredPrefixCache(cache, TierSettings(cpu_cache_gb=config.cpu_cache_gb, kv_cache_dir=config.kv_cache_dir,
                                                 disk_cache_gb=config.disk_cache_gb,
                                                 swap_on_preemption=config.swap_on_preemption))
