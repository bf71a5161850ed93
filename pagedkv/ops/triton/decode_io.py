"""Loads shared by the two decode kernels (`decode.py`, `decode_transposed.py`): page rows, q4/q6 codes in
units of four channels, and the sequence a packed query token belongs to."""

from __future__ import annotations

import triton
import triton.language as tl

from .conversions import nibble_quads_to_f16, six_bit_quads_to_f16


@triton.jit
def load_rows(ptr, row, offs, mask):
    """[WARPS, TILE_N, len(offs)] elements at ptr + row [WARPS, TILE_N] + offs."""
    return tl.load(ptr + row[:, :, None] + offs[None, None, :], mask=mask[:, :, None], other=0)


@triton.jit
def load_quads(ptr, row, offs_u, ok, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, FAST_CVT: tl.constexpr):
    """q4 / q6 codes of the rows at ptr + row [WARPS, TILE_N] in units of four channels: four float16
    tensors [WARPS, TILE_N, HEAD_DIM // 4], channel 4u + i in the i-th. A unit is one int16 of the nibble
    plane (plus, for q6, one byte of the 2-bit plane), so the matrix units read values as 16-bit pairs."""
    units = load_rows(ptr.to(tl.pointer_type(tl.int16)), row // 2, offs_u, ok)
    if BITS == 6:
        return six_bit_quads_to_f16(units, load_rows(ptr + HEAD_DIM // 2, row, offs_u, ok), FAST_CVT)
    return nibble_quads_to_f16(units, FAST_CVT)


@triton.jit
def token_sequence(token, query_start_loc_ptr, num_seqs):
    """The sequence whose query rows hold packed query token `token`: the last i with qsl[i] <= token."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
