"""Triton kernels for CUDA tensors: `write_kv` and `paged_attention` with the reference's signatures.

`supports` says whether they can run for a device and format. Kernel modules are imported on first
use, so importing this package needs neither Triton nor a GPU. The first launch of each kernel family
for a format compiles it (seconds each; Triton keeps the result in its cache, `~/.triton/cache` or
`TRITON_CACHE_DIR`, for later processes): `announced` says so on stderr, once per process.
"""

from __future__ import annotations

import sys
import time

import torch

from .gluon_support import gluon_available, gluon_prefill

_announced: set[tuple] = set()


def announced(kernels: str, fmt, dtype: torch.dtype, launch):
    """launch(). The first time in this process that `kernels` run for this format and dtype, say on stderr
    that they are being prepared (compiled, or loaded from Triton's cache) and, when that took over a second,
    how long it took; afterwards a set look-up is all it adds to a launch."""
    key = (kernels, fmt.spec, dtype)
    if key in _announced:
        return launch()
    _announced.add(key)
    print(f"pagedkv: preparing the Triton {kernels} kernels for {fmt.spec} pages ({str(dtype).removeprefix('torch.')}): "
          "compiled on first use, then kept in Triton's cache", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = launch()
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        print(f"pagedkv: Triton {kernels} kernels for {fmt.spec} pages ready in {elapsed:.1f} s", file=sys.stderr, flush=True)
    return out


def supports(device: torch.device, fmt) -> tuple[bool, str | None]:
    if torch.device(device).type != "cuda":
        return False, "cpu_device: tensors are not on a CUDA device"
    try:
        import triton
    except ImportError:
        return False, "no_triton: the triton package is not installed"
    if not hasattr(triton, "constexpr_function"):
        return False, f"old_triton: the kernels need triton.constexpr_function (triton 3.6 is tested), found {triton.__version__}"
    from .page_view import is_supported

    return is_supported(fmt)


def write_kv(pages, fmt, key, value, meta) -> None:
    """Encode key/value [num_input_tokens, num_kv_heads, head_dim] into the slots of `meta.slot_mapping`."""
    from .kv_write import write_kv as impl

    announced("cache-write", fmt, key.dtype, lambda: impl(pages, fmt, key, value, meta))


def paged_attention(query, pages, fmt, meta, *, scale, sliding_window=None, softcap=None, window=None):
    """Attention of packed queries [num_tokens, num_q_heads, head_dim] over one layer's pages.

    Decode-like batches over KV-Quant pages and the TurboQuant pages it reads run the warp-split decode
    kernel (`decode.py`), or on a GPU a Gluon kernel where one serves the format (`decode_gluon.launcher`:
    q8); other batches the varlen kernel, or split-K when the (query block, KV head)
    programs would not fill the GPU, except that on Hopper prefill batches over dense pages run the Gluon prefill
    kernel (`prefill_gluon.py`); with `tuning.DENSE_PREFILL`, prefill batches over quantized pages run
    through dense scratch pages (`dense_prefill.py`). Every choice is made from shapes alone.
    `window`: the layer's dense recent window (rings of keys and values, `decode.paged_attention`), for batches
    `reads_window` accepts: the warp-split decode kernel reads it beside the pages.
    """
    from .tuning import is_decode_like

    kernels = "decode" if is_decode_like(query.shape[0], meta.block_table.shape[0]) else "prefill"
    return announced(kernels, fmt, query.dtype, lambda: _paged_attention(
        query, pages, fmt, meta, scale=scale, sliding_window=sliding_window, softcap=softcap, window=window))


def reads_window(num_tokens: int, num_seqs: int, fmt, max_new_tokens: int | None = None,
                 meta=None) -> tuple[bool, str | None]:
    """Whether the kernels read a dense recent window (`recent_tokens`) for this batch, else why not: the
    warp-split decode kernel does, over pages it reads, for decode-like batches and for batches of at most
    WINDOW_MAX_NEW_TOKENS new tokens per sequence (`max_new_tokens`: speculative verify steps; one program per
    query token, each reading its sequence's pages and ring), whatever the split; with `tuning.DENSE_PREFILL`,
    the dense-scratch prefill does for the steps it takes (`meta`: the step's metadata). Other longer chunks
    (prefill with it off, or over its scratch budget) run the reference path."""
    from .decode import is_supported
    from .dense_prefill import step_of
    from .tuning import WINDOW_MAX_NEW_TOKENS, is_decode_like

    if meta is not None and step_of(fmt, meta) is not None:
        return True, None
    short = max_new_tokens is not None and max_new_tokens <= WINDOW_MAX_NEW_TOKENS
    if not (is_decode_like(num_tokens, num_seqs) or short):
        return False, (f"recent_tokens: the Triton kernels read the dense recent window in steps of at most "
                       f"{WINDOW_MAX_NEW_TOKENS} new tokens per sequence (decode, verify), and in prefill steps "
                       "through dense scratch pages (`tuning.DENSE_PREFILL`) within their scratch budget")
    if not is_supported(fmt):
        return False, f"recent_tokens: the Triton decode kernel that reads the dense recent window does not read {fmt.spec} pages"
    return True, None


def uses_warp_split(num_tokens: int, num_seqs: int, fmt) -> bool:
    """Decode-like batches over KV-Quant pages and the TurboQuant pages it reads (`decode.is_supported`) run
    the warp-split decode kernel: measured on an H200 1.1-2x faster than the varlen and split-K kernels there
    (TurboQuant with q4_0 keys, 4-bit values or rotated keys 1.4-1.9x, 2026-12-01; dense pages 0.91-0.97x, so
    they stay). (Here, not in `tuning`, which `decode` imports.)"""
    from .decode import is_supported
    from .tuning import is_decode_like, page_class

    return is_decode_like(num_tokens, num_seqs) and page_class(fmt) != "dense" and is_supported(fmt)


def gluon_decode(query, fmt, meta, **options):
    """(launcher, programs per multiprocessor) of the Gluon kernel that runs this batch (`decode_gluon.launcher`:
    decode-like batches on a GPU over pages it reads and serves by default), else None."""
    from .gluon_support import compiled
    from .tuning import is_decode_like

    if not (query.is_cuda and compiled() and is_decode_like(query.shape[0], meta.block_table.shape[0])):
        return None
    if not gluon_available():
        return None
    from . import decode_gluon

    return decode_gluon.launcher(fmt, query, meta.block_size, **options)


def _paged_attention(query, pages, fmt, meta, *, scale, sliding_window, softcap, window):
    from . import dense_prefill

    options = dict(scale=scale, sliding_window=sliding_window, softcap=softcap, window=window)
    if meta.parts is not None:
        return _mixed_attention(query, pages, fmt, meta.parts, **options)
    step = dense_prefill.step_of(fmt, meta)
    if step is None:
        return _kernel_attention(query, pages, fmt, meta, **options)
    # prefill chunks through dense scratch pages, the decodes before them as a batch alone
    if step.decodes is None:
        return dense_prefill.paged_attention(query, pages, fmt, meta, plan=step.plan, **options)
    split = meta.query_start_loc_cpu[step.start]
    out = torch.empty_like(query)
    out[:split] = _kernel_attention(query[:split], pages, fmt, step.decodes, **options)
    out[split:] = dense_prefill.paged_attention(query[split:], pages, fmt, step.chunks, plan=step.plan, **options)
    return out


def _mixed_attention(query, pages, fmt, parts, *, scale, sliding_window, softcap, window):
    """A step laid out for a mixed CUDA graph (`AttentionMetadata.parts`): its decode rows through the decode kernels,
    the prefill chunks after them through the fused varlen kernel; both launches sized from shapes alone."""
    from .tuning import choose_tiles, page_class

    assert window is None, "mixed CUDA graph steps do not read a dense recent window"
    decodes, chunks = parts
    n = decodes.block_table.shape[0]
    out = torch.empty_like(query)
    if n:
        out[:n] = _kernel_attention(query[:n], pages, fmt, decodes, scale=scale, sliding_window=sliding_window,
                                    softcap=softcap, window=None)
    rows = query[n:]
    num_tokens, num_q_heads, head_dim = rows.shape
    tiles = choose_tiles(num_tokens, chunks.block_table.shape[0], num_q_heads // fmt.num_kv_heads, head_dim,
                         query.device, pages=page_class(fmt), dtype=query.dtype)
    out[n:] = _tiled_attention(rows, pages, fmt, chunks, 1, tiles, scale=scale, sliding_window=sliding_window,
                               softcap=softcap)
    return out


def _kernel_attention(query, pages, fmt, meta, *, scale, sliding_window, softcap, window):
    """The decode, varlen or split-K kernel over the pages themselves."""
    from .tuning import plan_attention, warp_split_splits, warp_split_tiles

    num_tokens, num_q_heads, head_dim = query.shape
    capacity = meta.block_table.shape[1] * meta.block_size
    gluon = gluon_decode(query, fmt, meta, sliding_window=sliding_window, softcap=softcap, window=window)
    if gluon is not None:
        from .decode_gluon import MAX_SPLITS, resident_programs

        launch, programs_per_sm = gluon
        num_splits = min(MAX_SPLITS, warp_split_splits(num_tokens * fmt.num_kv_heads, capacity, query.device,
                                                       programs_per_sm, ordered=meta.token_order is not None,
                                                       resident_per_sm=resident_programs(fmt.spec, head_dim)))
        return launch(query, pages, fmt, meta, scale=scale, num_splits=num_splits,
                      **({"window": window} if window is not None else {}))
    if window is not None or uses_warp_split(num_tokens, meta.block_table.shape[0], fmt):
        from . import decode

        num_splits = warp_split_splits(num_tokens * fmt.num_kv_heads, capacity, query.device,
                                       warp_split_tiles(fmt).programs_per_sm, ordered=meta.token_order is not None)
        return decode.paged_attention(query, pages, fmt, meta, scale=scale, sliding_window=sliding_window,
                                      softcap=softcap, num_splits=num_splits, window=window)
    if window is None and gluon_prefill(query, pages, fmt, meta, sliding_window=sliding_window, softcap=softcap):
        from . import prefill_gluon

        return prefill_gluon.paged_attention(query, pages, fmt, meta, scale=scale)
    num_splits, tiles = plan_attention(num_tokens, meta.block_table.shape[0], num_q_heads // fmt.num_kv_heads,
                                       head_dim, fmt, capacity, query.device, query.dtype)
    return _tiled_attention(query, pages, fmt, meta, num_splits, tiles, scale=scale, sliding_window=sliding_window,
                            softcap=softcap)


def _tiled_attention(query, pages, fmt, meta, num_splits, tiles, *, scale, sliding_window, softcap):
    """The split-K kernel (num_splits > 1) or the varlen kernel at `tiles`, stepped down to smaller tiles where the
    GPU's shared memory is short (`tuning.launch_fitting`, remembered per kernel, device, dtype, format, head_dim)."""
    from . import attention, split_k
    from .tuning import launch_fitting

    if num_splits > 1:
        kernel, impl, extra = "split", split_k.paged_attention, {"num_splits": num_splits}
    else:
        kernel, impl, extra = "varlen", attention.paged_attention, {}

    def launch(t):
        return impl(query, pages, fmt, meta, scale=scale, sliding_window=sliding_window, softcap=softcap, tiles=t, **extra)

    _, num_q_heads, head_dim = query.shape
    return launch_fitting(launch, tiles, num_q_heads // fmt.num_kv_heads,
                          (kernel, query.device, query.dtype, fmt.spec, head_dim))


