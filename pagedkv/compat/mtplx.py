"""The seed's names, as thin aliases of pagedkv's own API.

Code written against MTPLX's `mtplx.cache_state` runs with only its import line changed:

    from pagedkv.compat.mtplx import VllmMetalPagedKVCache, install_vllm_metal_paged_attention_kv_cache

The seed's environment variables (`MTPLX_DYNAMIC_PAGED_KV`, `MTPLX_CONTEXT_WINDOW_TOKENS`) are read by
`pagedkv.config` as aliases of `PAGEDKV_DYNAMIC` and `PAGEDKV_CONTEXT_WINDOW_TOKENS`.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..cache import PagedKVCache
from ..hf import install_paged_kv_cache


class VllmMetalPagedKVCache(PagedKVCache):
    """`PagedKVCache` under the seed's name and keyword arguments.

    turboquant_config: e.g. {"k_quant": "q8_0", "v_quant": "q3_0"} (TurboQuant pages);
    kv_quant_config: e.g. {"mode": "q8", "dtype": "bf16"} (KV-Quant pages, dense mirror dtype);
    with both, TurboQuant is used. Other keywords are `PagedKVCache` options.
    """

    def __init__(self, *, block_size: int = 16, num_blocks: int = 1024, turboquant_config: Mapping | None = None,
                 kv_quant_config: Mapping | None = None, **options):
        super().__init__(block_size=block_size, num_blocks=num_blocks, turboquant_config=turboquant_config,
                         kv_quant_config=kv_quant_config, **options)


def install_vllm_metal_paged_attention_kv_cache(model: torch.nn.Module, *, block_size: int = 16,
                                                 num_blocks: int = 1024, turboquant_config: Mapping | None = None,
                                                 kv_quant_config: Mapping | None = None,
                                                 **options) -> PagedKVCache:
    """Route `model`'s attention through the paged cache and return a fresh cache for it
    (`pagedkv.install_paged_kv_cache` under the seed's name)."""
    return install_paged_kv_cache(model, block_size=block_size, num_blocks=num_blocks,
                                  turboquant_config=turboquant_config, kv_quant_config=kv_quant_config, **options)


__all__ = ["VllmMetalPagedKVCache", "install_vllm_metal_paged_attention_kv_cache"]
