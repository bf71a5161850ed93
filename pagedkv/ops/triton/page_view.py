"""What a kernel needs to read one layer's pages: the tensors of the format and its compile-time constants.

`page_view` is the only place that maps a `PageFormat` onto kernel arguments. Tensors a format does
not have are stood in for by its key pages (never read: the kernels branch on `kind` at compile time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...formats.base import PageFormat

DENSE, KVQUANT, TURBOQUANT = 0, 1, 2   # codecs.DENSE / KVQUANT / TURBOQUANT


@dataclass(frozen=True)
class PageView:
    kind: int                # DENSE | KVQUANT | TURBOQUANT (a tl.constexpr in the kernels)
    num_kv_heads: int
    head_dim: int
    k: torch.Tensor          # [num_blocks, block_size, num_kv_heads, width] key codes (or dense keys)
    v: torch.Tensor          # same for values
    k_scale: torch.Tensor    # [num_blocks, block_size, num_kv_heads, groups] (or a stand-in)
    k_zero: torch.Tensor     # same layout as k_scale
    v_scale: torch.Tensor    # [num_blocks, block_size, num_kv_heads, groups] (or a stand-in)
    codebook: torch.Tensor   # [levels] float32 value codebook (or a stand-in)
    rotation: torch.Tensor   # [head_dim, head_dim] float32: out = out_rot @ rotation (or a stand-in)
    k_bits: int = 0
    v_bits: int = 0
    rotate_out: bool = False


def page_view(fmt: PageFormat, pages: dict[str, torch.Tensor]) -> PageView:
    kind = fmt.spec.kind
    k, v = pages["k"], pages["v"]
    if kind == "dense":
        return PageView(DENSE, fmt.num_kv_heads, fmt.head_dim, k, v, k, k, k, k, k)
    if kind == "kvquant":
        return PageView(KVQUANT, fmt.num_kv_heads, fmt.head_dim, k, v, pages["k_scale"], k, pages["v_scale"], k, k,
                        k_bits=fmt.bits, v_bits=fmt.bits)
    raise AssertionError(f"no Triton page view for format kind {kind!r}")


def is_supported(fmt: PageFormat) -> tuple[bool, str | None]:
    kind = fmt.spec.kind
    if kind == "dense":
        return True, None
    if kind in ("kvquant",):
        d = fmt.head_dim
        if d & (d - 1):
            return False, f"head_dim: the quantized kernels need a power-of-two head_dim, got {d}"
        return True, None
    return False, f"no_kernel: no Triton kernel is built for {fmt.spec} pages yet"
