"""Identities: what a saved page is only valid for.

A page holds keys/values of one model, encoded in one page format with one block size. Two dicts say
which: `model_identity(model)` (architecture, layers, heads, head_dim, dtype, and a fingerprint of the
weights, or a name the user gives) and `cache_identity(cache)` (that, plus per layer the page format,
its fingerprint -- codebook and rotation included -- and the page tensors' names, widths and dtypes,
and the block size). Snapshot files carry the cache identity in their header; the tiered prefix cache
seeds its block hashes with its digest, so a block saved by one process is found by the next one only
when everything that shaped its bytes agrees.
"""

from __future__ import annotations

import hashlib
import json

import torch

IDENTITY_VERSION = 1
_FINGERPRINT_ELEMENTS = 4096  # elements sampled per weight tensor


def digest(obj) -> str:
    """sha256 hex digest of `obj` as canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape and dtype and an evenly strided sample of its values.

    Cheap (a few thousand elements per tensor) and stable across processes; two checkpoints that differ
    anywhere in the sampled elements or in any shape get different fingerprints.
    """
    h = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        if hasattr(param, "to_local"):  # a tensor-parallel shard (DTensor): its own part, no collective
            param = param.to_local()
        flat = param.detach().reshape(-1)
        if flat.numel() and not flat.is_meta:  # offloaded (meta) weights: name, shape and dtype only
            step = max(1, flat.numel() // _FINGERPRINT_ELEMENTS)
            sample = flat[::step][:_FINGERPRINT_ELEMENTS].to("cpu").contiguous()
            h.update(sample.view(torch.uint8).numpy().tobytes() if sample.element_size() else b"")
    return h.hexdigest()


def model_identity(model: torch.nn.Module, name: str | None = None) -> dict:
    """Architecture, layer count, heads, head_dim, dtype, a weights fingerprint, and `name` when given (two
    identities that both carry a name are compared by name instead of by fingerprint)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // num_heads if hidden and num_heads else None)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    identity = {
        "architecture": architectures[0],
        "num_layers": getattr(text, "num_hidden_layers", None),
        "num_attention_heads": num_heads,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or num_heads,
        "head_dim": head_dim,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "weights": weights_fingerprint(model),
    }
    if name is not None:
        identity["name"] = name
    return identity


def format_fingerprint(fmt) -> str:
    """sha256 over a bound page format's spec, page layout, page tensors and every tensor it holds (codebook,
    rotation signs)."""
    h = hashlib.sha256(str(fmt.spec.page_format).encode())
    h.update(fmt.page_layout.encode())   # how codes are laid out in a page's bytes
    for name, (width, dtype) in fmt.page_spec().items():
        h.update(f"{name}:{width}:{dtype}".encode())
    for attr, value in sorted(vars(fmt).items()):
        if isinstance(value, torch.Tensor):
            h.update(attr.encode())
            h.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def layer_identity(fmt) -> dict:
    return {
        "format": str(fmt.spec.page_format),
        "format_fingerprint": format_fingerprint(fmt),
        "num_kv_heads": fmt.num_kv_heads,
        "head_dim": fmt.head_dim,
        "dtype": str(fmt.dtype).removeprefix("torch."),
        "pages": {name: [width, str(dt).removeprefix("torch.")] for name, (width, dt) in fmt.page_spec().items()},
    }


def cache_identity(cache, formats: list | None = None) -> dict:
    """Everything that shaped the bytes of `cache`'s pages (of `formats`, the bound formats its layers would
    get, when it has none yet: see `PagedKVCache.init_layers`)."""
    formats = cache.formats if formats is None else formats
    return {
        "identity_version": IDENTITY_VERSION,
        "model": dict(cache.model_identity),
        "block_size": cache.block_size,
        "kv_format": str(cache.config.kv_format.page_format),
        "layers": [None if f is None else layer_identity(f) for f in formats],
    }


def differences(saved: dict, current: dict, path: str = "") -> list[str]:
    """Human-readable differences between two identities, e.g. "block_size: file 32, cache 16"."""
    out = []
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            if key == "weights" and "name" in saved and "name" in current:
                continue  # the user named the model on both sides: the name stands for the weights
            if key == "name" and (key not in saved or key not in current):
                continue
            out += differences(saved.get(key), current.get(key), f"{path}.{key}" if path else key)
        return out
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        for i, (a, b) in enumerate(zip(saved, current)):
            out += differences(a, b, f"{path}[{i}]")
        return out
    if saved != current:
        show = (lambda v: v[:12] + "..." if isinstance(v, str) and len(v) == 64 else
                (f"{len(v)} entries" if isinstance(v, list) else v))
        out.append(f"{path}: file {show(saved)}, cache {show(current)}")
    return out
