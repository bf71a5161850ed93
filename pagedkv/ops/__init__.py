"""Attention over pages and cache writes: the one place that routes to a kernel.

`write_kv` and `paged_attention` pick the Triton kernels (CUDA tensors, Triton importable, the format
supported) or the exact PyTorch reference, count the call in the caller's `OpCounters`, and warn once
per process, with the reason, when the fast path is not taken.
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING

import torch

from ..formats.base import PageFormat
from . import reference
from .metadata import AttentionMetadata
from .stats import OpCounters

if TYPE_CHECKING:
    from ..mirror import LayerMirror

__all__ = ["AttentionMetadata", "OpCounters", "write_kv", "paged_attention", "choose_backend", "PagedKVFallbackWarning"]


class PagedKVFallbackWarning(RuntimeWarning):
    """The fused kernels are not used; attention runs on the exact PyTorch path."""


_warned = False


def warn_fallback(reason: str) -> None:
    """Warn once per process that the fast path is not in use, and why."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"pagedkv: using the PyTorch reference attention instead of the Triton kernels ({reason})",
                      PagedKVFallbackWarning, stacklevel=3)


def choose_backend(device: torch.device, kernels: str, fmt: PageFormat) -> tuple[str, str | None]:
    """("triton" | "reference", reason the fast path was not taken or None)."""
    if kernels == "reference":
        return "reference", "kernels=reference"
    from . import triton as triton_ops

    ok, reason = triton_ops.supports(device, fmt)
    if ok:
        return "triton", None
    if kernels == "triton":
        from ..errors import ConfigError

        raise ConfigError(f"kernels='triton' was requested but the Triton kernels cannot run: {reason}; "
                          "use kernels='auto' or 'reference'")
    return "reference", reason


def write_kv(pages: dict[str, torch.Tensor], fmt: PageFormat, key: torch.Tensor, value: torch.Tensor,
             meta: AttentionMetadata, *, kernels: str = "auto", counters: OpCounters | None = None) -> None:
    """Encode `key`/`value` [num_input_tokens, num_kv_heads, head_dim] into the slots of `meta.slot_mapping`."""
    start = time.perf_counter()
    backend, _ = choose_backend(key.device, kernels, fmt)
    if backend == "triton":
        from .triton import write_kv as impl
    else:
        impl = reference.write_kv
    impl(pages, fmt, key, value, meta)
    if counters is not None:
        counters.write_calls += 1
        counters.cache_write_time_s += time.perf_counter() - start


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    kernels: str = "auto", counters: OpCounters | None = None,
                    mirror: "LayerMirror | None" = None,
                    window: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of packed queries [num_tokens, num_q_heads, head_dim] over one layer's pages.

    See `reference.paged_attention` for the semantics; returns [num_tokens, num_q_heads, head_dim].
    `mirror` (KV-Quant layers): the cache's dense mirror; each request's route is latched on its first
    call ("mirror" when the device runs the reference path, else "direct", even in a step that falls back,
    such as a prefill over a dense recent window) and requests on the mirror route are attended by the
    reference path over their dense copies.
    `window` (a dense recent window, `meta.window` set): this layer's rings, keys and values
    [num_rows, num_ring_blocks, block_size, H, D]; each sequence's blocks from `meta.window.first_block_cpu`
    on are read from there. The Triton decode kernel reads rings in decode and verify steps
    (`triton.reads_window`); other batches with a window (prefill) the dense-scratch prefill
    (`triton.dense_prefill`), which reads them too, or the reference path when that is off
    (`triton.tuning.DENSE_PREFILL`) or the step's context is over its scratch budget.
    """
    start = time.perf_counter()
    backend, reason = choose_backend(query.device, kernels, fmt)
    route = "mirror" if backend == "reference" else "direct"   # a request's route follows the device, not the step
    has_window = window is not None and meta.window is not None
    if has_window and backend == "triton":
        from .triton import reads_window

        qsl = meta.query_start_loc_cpu
        longest = max(b - a for a, b in zip(qsl, qsl[1:])) if query.shape[0] > 2 * (len(qsl) - 1) else None
        ok, why = reads_window(query.shape[0], meta.block_table.shape[0], fmt, longest, meta)
        if not ok:
            backend, reason = "reference", why
    sequence_kv = None
    if mirror is not None and meta.seq_ids is not None:
        routes = mirror.latch(meta.seq_ids, route)
        if "mirror" in routes:
            if backend != "reference":
                backend, reason = "reference", "kv_quant_mirror: a request in the batch is latched to the dense mirror"
            sequence_kv = _mirror_reader(mirror, routes, pages, fmt, meta)
    if has_window and backend == "reference":
        sequence_kv = _window_reader(window, sequence_kv, pages, fmt, meta)
    extra = {"window": window} if has_window and backend == "triton" else {}
    if sequence_kv is not None:
        extra["sequence_kv"] = sequence_kv
    if backend == "triton":
        from .triton import paged_attention as impl
    else:
        impl = reference.paged_attention
        warn_fallback(reason)
    out = impl(query, pages, fmt, meta, scale=scale, sliding_window=sliding_window, softcap=softcap, **extra)
    if counters is not None:
        counters.paged_attention_calls += 1
        counters.calls_by_phase[meta.phase] += 1
        kind = fmt.spec.kind
        if kind == "turboquant":
            counters.turboquant_attention_calls += 1
        elif kind == "kvquant":
            counters.kv_quant_attention_calls += 1
        if backend == "triton":
            counters.triton_attention_calls += 1
        else:
            counters.reference_attention_calls += 1
            counters.fallback_attention_calls += 1
            counters.bailouts[f"{meta.phase}:{reason.split(':')[0].replace(' ', '_')}"] += 1
        counters.attention_time_s += time.perf_counter() - start
    return out


def _mirror_reader(mirror: "LayerMirror", routes: list[str], pages, fmt: PageFormat, meta: AttentionMetadata):
    """sequence i -> its mirrored keys/values on the mirror route, None (read the pages) on the direct route."""

    def read(i: int):
        if routes[i] != "mirror":
            return None
        length = meta.seq_lens_cpu[i]
        n_blocks = -(-length // meta.block_size)
        return mirror.sequence_kv(meta.seq_ids[i], pages, fmt, meta.block_table[i, :n_blocks].long(), length,
                                  meta.block_size)

    return read


def _window_reader(window: tuple[torch.Tensor, torch.Tensor], base, pages, fmt: PageFormat, meta: AttentionMetadata):
    """sequence i -> its keys/values with the dense ring's blocks in place of the pages' (`base`: the mirror's
    reader or None), or what `base` gives when the sequence reads no block from its ring."""

    def read(i: int):
        body = base(i) if base is not None else None
        if meta.window.first_block_cpu[i] * meta.block_size >= meta.seq_lens_cpu[i]:
            return body
        return reference.window_kv(pages, fmt, meta, i, window, body)

    return read
