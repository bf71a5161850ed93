"""Page storage formats, one file each. `make_format` binds a `KVFormat` spec to a layer's shapes."""

from __future__ import annotations

import torch

from ..config import KVFormat
from .base import PageFormat
from .dense import DenseFormat


def make_format(spec: KVFormat, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> PageFormat:
    if spec.kind == "dense":
        return DenseFormat(spec, num_kv_heads, head_dim, dtype, device)
    if spec.kind == "kvquant":
        from .kvquant import KVQuantFormat

        return KVQuantFormat(spec, num_kv_heads, head_dim, dtype, device)
    if spec.kind == "turboquant":
        from .turboquant import TurboQuantFormat

        return TurboQuantFormat(spec, num_kv_heads, head_dim, dtype, device)
    raise AssertionError(f"unhandled format kind {spec.kind}")


__all__ = ["PageFormat", "DenseFormat", "make_format"]
