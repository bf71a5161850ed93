"""pagedkv: a paged, quantized key/value cache for LLM inference in PyTorch."""

from .cache import PagedKVCache
from .config import CacheConfig, KVFormat
from .errors import (CacheCapacityError, CacheMismatchError, ConfigError, ContextWindowError, ModelNotFoundError,
                     PagedKVError, SnapshotError, TierPathError)
from .hf import install_paged_kv_cache
from .models import load_model

__version__ = "0.1.0"

__all__ = [
    "PagedKVCache", "CacheConfig", "KVFormat", "install_paged_kv_cache", "load_model",
    "PagedKVError", "ConfigError", "ModelNotFoundError", "ContextWindowError", "CacheMismatchError",
    "CacheCapacityError", "SnapshotError", "TierPathError",
]


def __getattr__(name):  # the engine pulls in more of transformers; load it on first use
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
