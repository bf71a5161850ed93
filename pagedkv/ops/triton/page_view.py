"""What a kernel needs to read or write one layer's pages: the format's tensors and compile-time constants.

`page_view` is the only place that maps a `PageFormat` onto kernel arguments. Tensors a format does
not have are stood in for by its key pages (never read: the kernels branch on `kind` at compile time).
Small tensors derived from a format (TurboQuant's rotation matrices and codebook midpoints) are built
once per format object and kept while it lives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ...formats.base import PageFormat
from ...formats.codebook import decision_thresholds

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
    k_bits: int = 0
    v_bits: int = 0
    # TurboQuant (stand-ins otherwise)
    codebook: torch.Tensor | None = None      # [2**v_bits] float32 value centroids
    codebook_f16: torch.Tensor | None = None  # the same in float16, read by kernels with 16-bit queries
    thresholds: torch.Tensor | None = None    # [2**v_bits - 1] float32 midpoints between centroids
    value_signs: torch.Tensor | None = None   # [head_dim] float32 +-1 of the value rotation
    key_signs: torch.Tensor | None = None     # [head_dim] float32 +-1 of the key rotation (rotate_keys)
    q_rotation: torch.Tensor | None = None    # [head_dim, head_dim] float32: q_rot = q @ q_rotation
    out_rotation: torch.Tensor | None = None  # [head_dim, head_dim] float32: out = out_rot @ out_rotation
    scale_multipliers: torch.Tensor | None = None  # [m] float32 value-scale grid (multiples of the RMS)
    rotate_keys: bool = False
    rotate_out: bool = False

    def aux(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        return self.k if t is None else t


def stored_head_major(t: torch.Tensor) -> bool:
    """Whether page tensor t, indexed [num_blocks, block_size, num_kv_heads, width], is stored head-major as
    `formats.base.empty_pages` lays it out: in memory [num_blocks, num_kv_heads, block_size, width], contiguous (a
    block's slots of one head are one run, each slot's row right after the one before)."""
    return t.transpose(1, 2).is_contiguous()


def stride3(t: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot, head) strides of a page tensor, whose last dim must be contiguous."""
    assert t.stride(-1) == 1, f"page tensors need a contiguous last dim, got strides {t.stride()}"
    return (t.stride(0), t.stride(1), t.stride(2))


_derived: "weakref.WeakKeyDictionary[PageFormat, dict]" = weakref.WeakKeyDictionary()


def _key_rotation_tensors(fmt) -> dict:
    """rotate_keys (TurboQuant or KV-Quant): the signs the write kernel rotates keys with, and the matrix
    queries are rotated by (x @ key_rotation == hadamard.rotate(x, key_signs)); None without it."""
    if fmt.key_signs is None:
        return {"key_signs": None, "q_rotation": None}
    return {"key_signs": fmt.key_signs.float().contiguous(), "q_rotation": fmt.key_rotation.contiguous()}


def _turboquant_tensors(fmt) -> dict:
    if fmt not in _derived:
        cb = fmt.codebook.float().contiguous()
        _derived[fmt] = {
            "codebook": cb,
            "codebook_f16": cb.half(),
            "thresholds": decision_thresholds(cb).contiguous(),
            "value_signs": fmt.value_signs.float().contiguous(),
            "out_rotation": fmt.value_rotation.T.contiguous(),      # out = out_rot @ value_rotation.T
            "scale_multipliers": fmt.scale_grid,
            **_key_rotation_tensors(fmt),
        }
    return _derived[fmt]


def value_codebook(view: PageView, dtype: torch.dtype) -> torch.Tensor:
    """The TurboQuant codebook the attention kernels decode values with, for queries of `dtype`: in the
    kernels' compute dtype (`codecs.compute_dtype`: float16 for 16-bit queries, float32 otherwise). Other
    formats need none (their key pages stand in)."""
    if view.kind != TURBOQUANT:
        return view.k
    return view.codebook if dtype == torch.float32 else view.codebook_f16


def page_view(fmt: PageFormat, pages: dict[str, torch.Tensor]) -> PageView:
    kind = fmt.spec.kind
    k, v = pages["k"], pages["v"]
    if kind == "dense":
        return PageView(DENSE, fmt.num_kv_heads, fmt.head_dim, k, v, k, k, k)
    if kind == "kvquant":
        return PageView(KVQUANT, fmt.num_kv_heads, fmt.head_dim, k, v, pages["k_scale"], k, pages["v_scale"],
                        k_bits=fmt.bits, v_bits=fmt.bits, rotate_keys=fmt.key_signs is not None,
                        **_key_rotation_tensors(fmt))
    if kind == "turboquant":
        ks, kz = pages["k_scale"], pages["k_zero"]
        assert ks.shape == kz.shape and ks.stride() == kz.stride(), "k_scale and k_zero must share a layout"
        extra = _turboquant_tensors(fmt)
        return PageView(TURBOQUANT, fmt.num_kv_heads, fmt.head_dim, k, v, ks, kz, pages["v_scale"],
                        k_bits=fmt.key_bits, v_bits=fmt.value_bits, rotate_keys=fmt.key_signs is not None,
                        rotate_out=True, **extra)
    raise AssertionError(f"no Triton page view for format kind {kind!r}")


def is_supported(fmt: PageFormat) -> tuple[bool, str | None]:
    kind = fmt.spec.kind
    if kind == "dense":
        return True, None
    if kind in ("kvquant", "turboquant"):
        d = fmt.head_dim
        if d & (d - 1) or d < 32:
            return False, f"head_dim: the quantized kernels need a power-of-two head_dim >= 32, got {d}"
        return True, None
    return False, f"no_kernel: no Triton kernel is built for {fmt.spec} pages"


def ring_pages(view, meta, window: tuple[torch.Tensor, torch.Tensor]):
    """A dense recent window's rings of keys and values [num_rows, num_ring_blocks, block_size, H, D], checked
    against the step's plan of them (`meta.window`), as pages [num_rows * num_ring_blocks, block_size, H, D]."""
    plan = meta.window
    assert plan is not None, "reading a dense recent window needs the step's plan of it (meta.window)"
    keys, values = window
    assert keys.shape == values.shape and keys.stride() == values.stride(), "ring keys and values must share a layout"
    assert keys.shape[1:] == (plan.num_ring_blocks, meta.block_size, view.num_kv_heads, view.head_dim), \
        f"rings must be [num_rows, {plan.num_ring_blocks}, {meta.block_size}, {view.num_kv_heads}, {view.head_dim}], got {tuple(keys.shape)}"
    assert plan.rows.dtype == plan.first_block.dtype == torch.int32, "ring rows and first blocks must be int32"
    return keys.flatten(0, 1), values.flatten(0, 1)
