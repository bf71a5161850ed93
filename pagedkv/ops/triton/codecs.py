"""Device functions that read (decode) or write (encode) one tile of page slots, per storage format.

Each branch mirrors a format of `pagedkv/formats/` and is tested against that format's `encode` and
`decode`:
  DENSE       keys/values as stored.
  KVQUANT     code * scale, one float32 scale per (token, KV head); q8 stores int8 codes, q6/q4 store
              code + qmax as a little-endian bitstream (`formats/packing.py`).
  TURBOQUANT  keys (code + zero) * scale per group of 32; values codebook[code] * scale per group of 32
              in the rotated domain.
Attention applies per-token KV-Quant scales to whole score columns / probability columns rather than
to every element (the same products, regrouped); see `tiles.attend_tiles`.
"""

import triton
import triton.language as tl

DENSE: tl.constexpr = tl.constexpr(0)
KVQUANT: tl.constexpr = tl.constexpr(1)
TURBOQUANT: tl.constexpr = tl.constexpr(2)


@triton.constexpr_function
def chunk_bytes(bits):
    """Bytes of the shortest run of b-bit codes that ends on a byte boundary (`packing._chunk`)."""
    return {1: 1, 2: 1, 4: 1, 8: 1, 6: 3}.get(bits, bits)


@triton.constexpr_function
def chunk_codes(bits):
    return {1: 8, 2: 4, 4: 2, 8: 1, 6: 4}.get(bits, 8)


@triton.jit
def round_half_even(x):
    """torch.round: nearest integer, ties to even (x - floor(x) is exact for |x| < 2**23)."""
    r = tl.floor(x)
    frac = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def unpack_codes(ptr, row, in_range, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Codes [N, HEAD_DIM] int32 of the bitstreams starting at ptr + row [N] (bits [i*BITS, (i+1)*BITS))."""
    N: tl.constexpr = row.shape[0]
    if BITS == 8:
        offs = tl.arange(0, HEAD_DIM)
        codes = tl.load(ptr + row[:, None] + offs[None, :], mask=in_range[:, None], other=0).to(tl.int32)
    else:
        CB: tl.constexpr = chunk_bytes(BITS)
        CC: tl.constexpr = chunk_codes(BITS)
        offs_j = tl.arange(0, HEAD_DIM // CC)
        base = ptr + row[:, None] + offs_j[None, :] * CB
        if CB <= 3:
            word = tl.zeros([N, HEAD_DIM // CC], dtype=tl.int32)
        else:
            word = tl.zeros([N, HEAD_DIM // CC], dtype=tl.int64)
        for k in tl.static_range(CB):
            byte = tl.load(base + k, mask=in_range[:, None], other=0)
            word = word | (byte.to(word.dtype) << (8 * k))
        shifts = tl.arange(0, CC) * BITS
        fields = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)   # [N, HEAD_DIM // CC, CC]
        codes = tl.reshape(fields, [N, HEAD_DIM]).to(tl.int32)
    return codes


@triton.jit
def pack_codes(ptr, row, codes, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Store codes [R, HEAD_DIM] (int32 in [0, 2**BITS)) as bitstreams at ptr + row [R]."""
    R: tl.constexpr = row.shape[0]
    if BITS == 8:
        offs = tl.arange(0, HEAD_DIM)
        tl.store(ptr + row[:, None] + offs[None, :], codes.to(ptr.dtype.element_ty))
    else:
        CB: tl.constexpr = chunk_bytes(BITS)
        CC: tl.constexpr = chunk_codes(BITS)
        fields = tl.reshape(codes, [R, HEAD_DIM // CC, CC])
        shifts = tl.arange(0, CC) * BITS
        if CB <= 3:
            word = tl.sum(fields << shifts[None, None, :], axis=2)               # disjoint bit fields: sum == or
        else:
            word = tl.sum(fields.to(tl.int64) << shifts[None, None, :].to(tl.int64), axis=2)
        offs_j = tl.arange(0, HEAD_DIM // CC)
        base = ptr + row[:, None] + offs_j[None, :] * CB
        for k in tl.static_range(CB):
            tl.store(base + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8))


@triton.jit
def load_keys(k_ptr, ks_ptr, kz_ptr, block, slot, in_range, k_strides, ks_strides,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KIND: tl.constexpr, K_BITS: tl.constexpr, DTYPE):
    """Keys of slots (block, slot) [TILE_N] as [TILE_N, HEAD_DIM_PAD] in DTYPE, zeros outside `in_range`.

    KVQUANT returns the integer codes (exact in DTYPE): the caller scales score columns."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = block * k_strides[0] + slot * k_strides[1]
    if KIND == KVQUANT:
        codes = unpack_codes(k_ptr, row, in_range, HEAD_DIM, K_BITS)
        if K_BITS != 8:
            codes = codes - ((1 << (K_BITS - 1)) - 1)
        k = codes.to(DTYPE)
    else:
        mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DTYPE)
    return k


@triton.jit
def load_values(v_ptr, vs_ptr, codebook_ptr, block, slot, in_range, v_strides, vs_strides,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KIND: tl.constexpr, V_BITS: tl.constexpr, DTYPE):
    """Values of slots (block, slot) [TILE_N] as [TILE_N, HEAD_DIM_PAD] in DTYPE, zeros outside `in_range`.

    KVQUANT returns the integer codes: the caller scales probability columns."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = block * v_strides[0] + slot * v_strides[1]
    if KIND == KVQUANT:
        codes = unpack_codes(v_ptr, row, in_range, HEAD_DIM, V_BITS)
        if V_BITS != 8:
            codes = codes - ((1 << (V_BITS - 1)) - 1)
        v = codes.to(DTYPE)
    else:
        mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DTYPE)
    return v


@triton.jit
def load_token_scales(s_ptr, block, slot, in_range, s_strides):
    """One float32 scale per slot: [TILE_N] (KV-Quant)."""
    return tl.load(s_ptr + block * s_strides[0] + slot * s_strides[1], mask=in_range, other=0.0)


@triton.jit
def encode_kvquant(ptr, s_ptr, row, s_row, x, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Quantize x [R, HEAD_DIM_PAD] float32 (zero padded) per row and store codes and scales."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / QMAX, 1e-6)                     # [R]
    codes = round_half_even(x / scale[:, None])
    codes = tl.minimum(tl.maximum(codes, -QMAX), QMAX).to(tl.int32)
    if BITS != 8:
        codes = codes + QMAX
    pack_codes(ptr, row, codes, HEAD_DIM, BITS)
    tl.store(s_ptr + s_row, scale)
