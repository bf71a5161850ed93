"""Device functions that read (decode) or write (encode) one tile of page slots, per storage format.

Each branch mirrors a format of `pagedkv/formats/` and is tested against that format's `encode` and
`decode`:
  DENSE       keys/values as stored.
  KVQUANT     code * scale, one float32 scale per (token, KV head); q8 stores int8 codes, q4 stores
              code + qmax as a little-endian bitstream, q6 as two planes (`formats/packing.py`).
  TURBOQUANT  keys (code + zero) * scale per group of 32; values codebook[code] * scale per group of 32
              in the rotated domain (3- and 4-bit codes as code and sign nibbles in units of eight channels).
Attention applies per-token KV-Quant scales to whole score columns / probability columns rather than
to every element (the same products, regrouped); see `tiles.attend_tiles`.
"""

import triton
import triton.language as tl

DENSE = tl.constexpr(0)
KVQUANT = tl.constexpr(1)
TURBOQUANT = tl.constexpr(2)
GROUP = tl.constexpr(32)   # TurboQuant's quantization group along head_dim


@triton.constexpr_function
def chunk_bytes(bits):  # (for pack_codes)
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
def load_words(ptr, row, in_range, UNIT_BYTES: tl.constexpr, UNITS: tl.constexpr, K: tl.constexpr):
    """int32 word K of each UNIT_BYTES-byte unit of the rows at ptr + row [N]: [N, UNITS]."""
    offs = tl.arange(0, UNITS) * UNIT_BYTES + 4 * K
    p = (ptr + row[:, None] + offs[None, :]).to(tl.pointer_type(tl.int32))
    return tl.load(p, mask=in_range[:, None], other=0)


@triton.jit
def join4(c0, c1, c2, c3):
    """[..., 4] holding c0, c1, c2, c3 in this order (join appends a last dim: the outer join picks the low bit)."""
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(x, [x.shape[0], x.shape[1], 4])


@triton.jit
def join8(c0, c1, c2, c3, c4, c5, c6, c7):
    x = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(x, [x.shape[0], x.shape[1], 8])


@triton.jit
def split_fields(x, BITS: tl.constexpr, PER: tl.constexpr):
    """x [N, J] int32 holding PER codes of BITS bits each (lowest first) -> [N, J * PER], each code next
    to its neighbours in the same thread (joins keep the new axis in-thread; a broadcast would not)."""
    M: tl.constexpr = (1 << BITS) - 1
    if PER == 2:
        f = tl.join(x & M, (x >> BITS) & M)
    elif PER == 4:
        f = join4(x & M, (x >> BITS) & M, (x >> 2 * BITS) & M, (x >> 3 * BITS) & M)
    else:
        tl.static_assert(PER == 8, "2, 4 or 8 codes per field group")
        f = join8(x & M, (x >> BITS) & M, (x >> 2 * BITS) & M, (x >> 3 * BITS) & M,
                  (x >> 4 * BITS) & M, (x >> 5 * BITS) & M, (x >> 6 * BITS) & M, (x >> 7 * BITS) & M)
    return tl.reshape(f, [x.shape[0], x.shape[1] * PER])


@triton.jit
def unpack_codes(ptr, row, in_range, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Codes [N, HEAD_DIM] int32 of the little-endian bitstreams at ptr + row [N] (code i in bits
    [i*BITS, (i+1)*BITS)); 8-bit codes are read as the page's dtype (int8: signed).

    8-, 4- and 2-bit codes are read as bytes; 3-, 6- and 5-bit codes as int32 words (a row holds 4*BITS
    bytes per 32 codes, so words never straddle rows). Codes are cut out with shifts known at compile
    time: no per-code loads or gathers."""
    N: tl.constexpr = row.shape[0]
    if BITS == 8:
        offs = tl.arange(0, HEAD_DIM)
        codes = tl.load(ptr + row[:, None] + offs[None, :], mask=in_range[:, None], other=0).to(tl.int32)
    elif BITS == 4 or BITS == 2 or BITS == 1:
        offs = tl.arange(0, HEAD_DIM * BITS // 8)
        x = tl.load(ptr + row[:, None] + offs[None, :], mask=in_range[:, None], other=0).to(tl.int32)
        codes = split_fields(x, BITS, 8 // BITS)
    elif BITS == 3 or BITS == 6:                       # 3 words = 4 chunks of 24 bits
        UNITS: tl.constexpr = HEAD_DIM * BITS // 96
        w0 = load_words(ptr, row, in_range, 12, UNITS, 0)
        w1 = load_words(ptr, row, in_range, 12, UNITS, 1)
        w2 = load_words(ptr, row, in_range, 12, UNITS, 2)
        chunks = join4(w0 & 0xFFFFFF, ((w0 >> 24) & 0xFF) | ((w1 & 0xFFFF) << 8),
                       ((w1 >> 16) & 0xFFFF) | ((w2 & 0xFF) << 16), (w2 >> 8) & 0xFFFFFF)
        codes = split_fields(tl.reshape(chunks, [N, UNITS * 4]), BITS, 24 // BITS)
    else:                                              # BITS == 5: 5 words = 8 chunks of 20 bits
        tl.static_assert(BITS == 5, "packed codes of 2, 3, 4, 5, 6 or 8 bits")
        UNITS: tl.constexpr = HEAD_DIM // 32
        w0 = load_words(ptr, row, in_range, 20, UNITS, 0)
        w1 = load_words(ptr, row, in_range, 20, UNITS, 1)
        w2 = load_words(ptr, row, in_range, 20, UNITS, 2)
        w3 = load_words(ptr, row, in_range, 20, UNITS, 3)
        w4 = load_words(ptr, row, in_range, 20, UNITS, 4)
        chunks = join8(w0 & 0xFFFFF, ((w0 >> 20) & 0xFFF) | ((w1 & 0xFF) << 12), (w1 >> 8) & 0xFFFFF,
                       ((w1 >> 28) & 0xF) | ((w2 & 0xFFFF) << 4), ((w2 >> 16) & 0xFFFF) | ((w3 & 0xF) << 16),
                       (w3 >> 4) & 0xFFFFF, ((w3 >> 24) & 0xFF) | ((w4 & 0xFFF) << 8), (w4 >> 12) & 0xFFFFF)
        codes = split_fields(tl.reshape(chunks, [N, UNITS * 8]), 5, 4)
    return codes


@triton.jit
def nibble_fields(HEAD_DIM: tl.constexpr):
    """TurboQuant 3- and 4-bit values lie in units (`packing.unit_order`): channel j D/8 + u is field j of unit u,
    so the channel-order codes [N, HEAD_DIM] reshape to a [N, 8, D/8] grid of (field, unit) with no permute. Here:
    the field index [1, 8, 1] and the unit offsets [1, 1, D/8] of that grid."""
    return tl.arange(0, 8)[None, :, None], tl.arange(0, HEAD_DIM // 8)[None, None, :]


@triton.jit
def high_bit_of(j):
    """Where field j >= 4 of a code-nibbles unit keeps its bit 2 in the M word: bit 3 of nibble k, where
    `packing.NIBBLE_HIGH_BITS`[k] == j (4, 6, 5, 7 -> k = 0, 1, 2, 3)."""
    f = tl.maximum(j - 4, 0)
    return 4 * (2 * (f & 1) + (f >> 1)) + 3


@triton.jit
def unpack_code_nibbles(ptr, row, in_range, HEAD_DIM: tl.constexpr):
    """3-bit codes [N, HEAD_DIM] int32 in [0, 8) of the code nibbles at ptr + row [N] (`packing.pack_code_nibbles`):
    unit u's M word at bytes 2u, 2u + 1, its N byte at D/4 + u; field j < 4 is nibble j of M (bits 0-2), field
    j >= 4 bits 0-1 from N and bit 2 from a spare bit of M. Each unit's words are broadcast over its fields and
    shifted, so the codes come out in channel order with no permute (a register permute of the unit grid wrote
    wrong codes when compiled for an H200, though right under the interpreter)."""
    N: tl.constexpr = row.shape[0]
    j, u = nibble_fields(HEAD_DIM)
    r = row[:, None, None]
    ok = in_range[:, None, None]
    m = (tl.load(ptr + r + 2 * u, mask=ok, other=0).to(tl.int32)
         | (tl.load(ptr + r + 2 * u + 1, mask=ok, other=0).to(tl.int32) << 8))                # [N, 1, J]
    n = tl.load(ptr + HEAD_DIM // 4 + r + u, mask=ok, other=0).to(tl.int32)
    low = (m >> (4 * j)) & 7
    rest = ((n >> (2 * tl.maximum(j - 4, 0))) & 3) | (((m >> high_bit_of(j)) & 1) << 2)
    return tl.reshape(tl.where(j < 4, low, rest), [N, HEAD_DIM])


@triton.jit
def pack_code_nibbles(ptr, row, codes, HEAD_DIM: tl.constexpr):
    """Store 3-bit codes [R, HEAD_DIM] (int32 in [0, 8), channel order) as code nibbles at ptr + row [R] (the layout
    `unpack_code_nibbles` reads): each word is the sum of its codes' shifted bit fields over the field axis of the
    (field, unit) grid, with no permute."""
    R: tl.constexpr = row.shape[0]
    J: tl.constexpr = HEAD_DIM // 8
    j, _ = nibble_fields(HEAD_DIM)
    c = tl.reshape(codes, [R, 8, J])
    m = tl.sum(tl.where(j < 4, (c & 7) << (4 * j), (c >> 2) << high_bit_of(j)), axis=1)         # [R, J]
    n = tl.sum(tl.where(j < 4, 0, (c & 3) << (2 * tl.maximum(j - 4, 0))), axis=1)
    at = ptr + row[:, None] + tl.arange(0, J)[None, :]                                          # unit u: [R, J]
    tl.store(at + tl.arange(0, J)[None, :], (m & 0xFF).to(tl.uint8))                            # byte 2u
    tl.store(at + tl.arange(0, J)[None, :] + 1, (m >> 8).to(tl.uint8))                          # byte 2u + 1
    tl.store(at + HEAD_DIM // 4, n.to(tl.uint8))                                                 # byte D/4 + u


@triton.jit
def unpack_sign_nibbles(ptr, row, in_range, HEAD_DIM: tl.constexpr):
    """4-bit codes [N, HEAD_DIM] int32 in [0, 16) of the sign nibbles at ptr + row [N] (`packing.pack_sign_nibbles`):
    unit u's fields 2b, 2b + 1 in the low and high nibble of byte 4u + b, each a magnitude index (bits 0-2) and a
    sign (bit 3); broadcast and shifted as in `unpack_code_nibbles`."""
    N: tl.constexpr = row.shape[0]
    j, u = nibble_fields(HEAD_DIM)
    b = tl.load(ptr + row[:, None, None] + 4 * u + j // 2, mask=in_range[:, None, None], other=0).to(tl.int32)
    nib = (b >> (4 * (j % 2))) & 15                                                             # [N, 8, J]
    codes = tl.where(nib >= 8, 7 - (nib & 7), 8 + (nib & 7))
    return tl.reshape(codes, [N, HEAD_DIM])


@triton.jit
def pack_sign_nibbles(ptr, row, codes, HEAD_DIM: tl.constexpr):
    """Store 4-bit codes [R, HEAD_DIM] (int32 in [0, 16), channel order) as sign nibbles at ptr + row [R] (the layout
    `unpack_sign_nibbles` reads)."""
    R: tl.constexpr = row.shape[0]
    J: tl.constexpr = HEAD_DIM // 8
    nib = tl.where(codes < 8, (7 - codes) | 8, codes - 8)
    a = tl.arange(0, 2)[None, None, :, None]
    byte = tl.sum(tl.reshape(nib, [R, 4, 2, J]) << (4 * a), axis=2)                            # [R, 4, J]
    offs_b = tl.arange(0, 4)[None, :, None]
    offs_u = tl.arange(0, J)[None, None, :]
    tl.store(ptr + row[:, None, None] + 4 * offs_u + offs_b, byte.to(tl.uint8))


@triton.jit
def int_to_float(c):
    """Exact float32 of int32 c, |c| < 2**22, by its bits (2**23 + 2**22 + c) - (2**23 + 2**22): two full-rate
    operations instead of a quarter-rate conversion."""
    return (c + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


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
def load_group_scales(ptr, block, slot, in_range, strides, HEAD_DIM: tl.constexpr):
    """Per-group (32 elements) fp16 factors of slots (block, slot) [N], broadcast to [N, HEAD_DIM // 32, 32] float32."""
    offs_g = tl.arange(0, HEAD_DIM // GROUP)
    row = block * strides[0] + slot * strides[1]
    f = tl.load(ptr + row[:, None] + offs_g[None, :], mask=in_range[:, None], other=0.0).to(tl.float32)
    return f[:, :, None]


@triton.constexpr_function
def compute_dtype(kind, dtype):
    """The dtype keys and values of a page format are rebuilt in for `tl.dot` with queries of `dtype`.

    TurboQuant rebuilds 16-bit keys and values in float16 whatever the queries' 16-bit dtype: its fp16
    scales and zero points then need no conversion, code + zero (|.| <= 1151) is exact, and float16 keeps
    3 more mantissa bits than bfloat16. The price is float16's range: a rebuilt key or value beyond
    65504 in magnitude would overflow (the reference path computes in float32), orders of magnitude
    above what attention projections produce."""
    if kind == TURBOQUANT and dtype != tl.float32:
        return tl.float16
    return dtype


@triton.jit
def pick4(b0, b1, cb_ptr):
    return tl.where(b1, tl.where(b0, tl.load(cb_ptr + 3), tl.load(cb_ptr + 2)),
                    tl.where(b0, tl.load(cb_ptr + 1), tl.load(cb_ptr)))


@triton.jit
def codebook_lookup(codes, cb_ptr, BITS: tl.constexpr):
    """codebook[codes] in the codebook's dtype: a select tree over the centroids (each one a uniform load,
    hoisted out of the key loop) for up to 4 bits, a gather beyond. A per-element gather from a table
    (tried: pairs of centroids, two codes per load) measured 2x slower on an H200: the load/store unit, not
    the arithmetic, is then the limit."""
    if BITS > 4:
        v = tl.load(cb_ptr + codes)
    else:
        b0 = (codes & 1) != 0
        b1 = (codes & 2) != 0
        if BITS == 1:
            v = tl.where(b0, tl.load(cb_ptr + 1), tl.load(cb_ptr))
        elif BITS == 2:
            v = pick4(b0, b1, cb_ptr)
        else:
            b2 = (codes & 4) != 0
            v = tl.where(b2, pick4(b0, b1, cb_ptr + 4), pick4(b0, b1, cb_ptr))
            if BITS == 4:
                b3 = (codes & 8) != 0
                v = tl.where(b3, tl.where(b2, pick4(b0, b1, cb_ptr + 12), pick4(b0, b1, cb_ptr + 8)), v)
    return v


@triton.jit
def load_dense(ptr, row, in_range, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, DTYPE):
    """Dense rows at ptr + row [N] as [N, HEAD_DIM_PAD] in DTYPE, zeros outside `in_range` and past HEAD_DIM."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
    return tl.load(ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DTYPE)


@triton.jit
def load_kvquant_codes(ptr, row, in_range, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, DTYPE):
    """KV-Quant's signed integer codes at ptr + row [N] as [N, HEAD_DIM] in DTYPE (exact): int8 codes convert
    straight to DTYPE (packed conversions); q6/q4 are stored as code + qmax in a bitstream."""
    if BITS == 8:
        offs_d = tl.arange(0, HEAD_DIM)
        return tl.load(ptr + row[:, None] + offs_d[None, :], mask=in_range[:, None], other=0).to(DTYPE)
    if BITS == 6:   # two planes (`packing.pack_planes`): low nibbles, then high 2-bit fields
        codes = (unpack_codes(ptr, row, in_range, HEAD_DIM, 4, False)
                 + 16 * unpack_codes(ptr + HEAD_DIM // 2, row, in_range, HEAD_DIM, 2, False)) - 31
    else:
        codes = unpack_codes(ptr, row, in_range, HEAD_DIM, BITS, False) - ((1 << (BITS - 1)) - 1)
    return int_to_float(codes).to(DTYPE)


@triton.jit
def load_keys(k_ptr, ks_ptr, kz_ptr, block, slot, in_range, k_strides, ks_strides,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KIND: tl.constexpr, K_BITS: tl.constexpr, DTYPE):
    """Keys of slots (block, slot) [TILE_N] as [TILE_N, HEAD_DIM_PAD] in compute_dtype(KIND, DTYPE), zeros
    outside `in_range`.

    KVQUANT returns the integer codes (exact in DTYPE): the caller scales score columns."""
    N: tl.constexpr = block.shape[0]
    CDTYPE: tl.constexpr = compute_dtype(KIND, DTYPE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = block * k_strides[0] + slot * k_strides[1]
    if KIND == KVQUANT:
        k = load_kvquant_codes(k_ptr, row, in_range, HEAD_DIM, K_BITS, CDTYPE)
    elif KIND == TURBOQUANT:  # (code + zero) * scale per group of 32 (signed int8 codes for 8 bits)
        zero = load_group_scales(kz_ptr, block, slot, in_range, ks_strides, HEAD_DIM)
        scale = load_group_scales(ks_ptr, block, slot, in_range, ks_strides, HEAD_DIM).to(CDTYPE)
        if K_BITS == 8:
            c = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=in_range[:, None], other=0)   # int8
            if CDTYPE == tl.float16:
                # the float16 whose bits are c + 0x6480 is 1152 + c (1024 <= . < 2048, exact), minus 1152:
                # an integer add and a packed half add instead of a quarter-rate conversion
                codes = (c.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
            else:
                codes = c.to(CDTYPE)
        else:
            codes = int_to_float(unpack_codes(k_ptr, row, in_range, HEAD_DIM, K_BITS, False)).to(CDTYPE)
        codes = tl.reshape(codes, [N, HEAD_DIM // GROUP, GROUP])
        k = tl.reshape((codes + zero.to(CDTYPE)) * scale, [N, HEAD_DIM])
    else:
        k = load_dense(k_ptr, row, in_range, HEAD_DIM, HEAD_DIM_PAD, DTYPE)
    return k


@triton.jit
def load_values(v_ptr, vs_ptr, codebook_ptr, block, slot, in_range, v_strides, vs_strides,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KIND: tl.constexpr, V_BITS: tl.constexpr, DTYPE):
    """Values of slots (block, slot) [TILE_N] as [TILE_N, HEAD_DIM_PAD] in compute_dtype(KIND, DTYPE), zeros
    outside `in_range`.

    KVQUANT returns the integer codes: the caller scales probability columns. TURBOQUANT returns the
    values in the rotated domain, decoded with the codebook at `codebook_ptr` (`page_view.value_codebook`)."""
    N: tl.constexpr = block.shape[0]
    CDTYPE: tl.constexpr = compute_dtype(KIND, DTYPE)
    row = block * v_strides[0] + slot * v_strides[1]
    if KIND == KVQUANT:
        v = load_kvquant_codes(v_ptr, row, in_range, HEAD_DIM, V_BITS, CDTYPE)
    elif KIND == TURBOQUANT:  # codebook[code] * rms scale per group of 32
        if V_BITS == 3:
            codes = unpack_code_nibbles(v_ptr, row, in_range, HEAD_DIM)
        elif V_BITS == 4:
            codes = unpack_sign_nibbles(v_ptr, row, in_range, HEAD_DIM)
        else:
            codes = unpack_codes(v_ptr, row, in_range, HEAD_DIM, V_BITS, False)
        codes = tl.reshape(codes, [N, HEAD_DIM // GROUP, GROUP])
        centroids = codebook_lookup(codes, codebook_ptr, V_BITS).to(CDTYPE)
        scale = load_group_scales(vs_ptr, block, slot, in_range, vs_strides, HEAD_DIM).to(CDTYPE)
        v = tl.reshape(centroids * scale, [N, HEAD_DIM])
    else:
        v = load_dense(v_ptr, row, in_range, HEAD_DIM, HEAD_DIM_PAD, DTYPE)
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
    if BITS == 6:   # two planes (`packing.pack_planes`)
        pack_codes(ptr, row, codes & 15, HEAD_DIM, 4)
        pack_codes(ptr + HEAD_DIM // 2, row, codes >> 4, HEAD_DIM, 2)
    else:
        pack_codes(ptr, row, codes, HEAD_DIM, BITS)
    tl.store(s_ptr + s_row, scale)


@triton.jit
def fwht(x, HEAD_DIM: tl.constexpr, LOG2_HEAD_DIM: tl.constexpr):
    """Unnormalised Walsh-Hadamard transform of each row of x [R, HEAD_DIM]: the butterflies of
    `formats.hadamard.fwht` in the same order, so float32 results are identical."""
    R: tl.constexpr = x.shape[0]
    for stage in tl.static_range(LOG2_HEAD_DIM):   # butterflies of span h = 2**stage
        y = tl.permute(tl.reshape(x, [R, HEAD_DIM >> (stage + 1), 2, 1 << stage]), [0, 1, 3, 2])
        a, b = tl.split(y)                                        # [R, HEAD_DIM // (2h), h] each
        y = tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2])
        x = tl.reshape(y, [R, HEAD_DIM])
    return x


@triton.jit
def round_up_fp16(x):
    """The smallest fp16 value >= x (x float32, positive), as in `turboquant._round_up_fp16`."""
    h = x.to(tl.float16)
    up = (h.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < x, up, h)


@triton.jit
def encode_turboquant_keys(ptr, s_ptr, z_ptr, row, s_row, x, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Quantize x [R, HEAD_DIM] float32 per group of 32 (`turboquant.quantize_keys`) and store codes,
    fp16 scales and zero points (s_row addresses both the scale and the zero tensors)."""
    R: tl.constexpr = x.shape[0]
    G: tl.constexpr = HEAD_DIM // GROUP
    g = tl.reshape(x, [R, G, GROUP])
    hi = tl.max(g, axis=2)
    lo = tl.min(g, axis=2)
    LEVELS: tl.constexpr = 254 if BITS == 8 else (1 << BITS) - 1
    amax = tl.maximum(tl.abs(hi), tl.abs(lo))
    scale = tl.maximum(tl.maximum((hi - lo) / LEVELS, amax / 1024.0), 1e-7)
    scale16 = round_up_fp16(scale)
    s = scale16.to(tl.float32)
    if BITS == 8:
        zero = round_half_even((hi + lo) / (2.0 * s))
        codes = tl.minimum(tl.maximum(round_half_even(g / s[:, :, None] - zero[:, :, None]), -127.0), 127.0)
    else:
        zero = round_half_even(lo / s)
        codes = tl.minimum(tl.maximum(round_half_even(g / s[:, :, None] - zero[:, :, None]), 0.0), LEVELS)
    pack_codes(ptr, row, tl.reshape(codes.to(tl.int32), [R, HEAD_DIM]), HEAD_DIM, BITS)
    offs_g = tl.arange(0, G)
    tl.store(s_ptr + s_row[:, None] + offs_g[None, :], scale16)
    tl.store(z_ptr + s_row[:, None] + offs_g[None, :], zero.to(tl.float16))


@triton.constexpr_function
def log2(n):
    return n.bit_length() - 1


@triton.jit
def halving_sum(v, LANES: tl.constexpr):
    """Sums of v [A, B, N] over its last axis (N = 2, 4, 8 or 16) as [A, B], in the order of a warp's butterfly
    reduction over N lanes that hold the elements in order: element e added to e + N/2 first, then to e + N/4,
    and so on. With LANES (compiled, the axis laid out across lanes, one element each: tests/triton/
    test_sm90_write.py checks the layouts of `write_kv`) that is what `tl.sum` does. Otherwise -- the interpreter
    sums with numpy's own order, and gathered loads give the compiler other layouts -- the levels are spelled
    out, each a sum of two, exact in any order and layout."""
    A: tl.constexpr = v.shape[0]
    B: tl.constexpr = v.shape[1]
    N: tl.constexpr = v.shape[2]
    if LANES:
        return tl.sum(v, axis=2)
    for level in tl.static_range(log2(N)):
        v = tl.sum(tl.reshape(v, [A, B, 2, N >> (level + 1)]), axis=2)
    return tl.reshape(v, [A, B])


@triton.jit
def group_rms(g, LANES: tl.constexpr):
    """sqrt(mean(g * g)) per group of g [G, 32] as [G], the squares summed in one fixed order: for e < 16,
    fma(g_e, g_e, g_{e+16}^2), then `halving_sum`. That is the sum lanes 0-15 computed when the kernel reduced a
    group with one element per lane; lanes 16-31 fused the other square of each pair, so their sum could end one
    float32 step apart, and the two halves of a group then saw a candidate scale one fp16 step apart now and then
    (and the stored scale was either). Here every element and the stored scale see the same sum."""
    G: tl.constexpr = g.shape[0]
    lo, hi = tl.split(tl.permute(tl.reshape(g, [G, 2, GROUP // 2]), [0, 2, 1]))        # elements e, e + 16
    sq = tl.fma(lo, lo, hi * hi)
    return tl.sqrt_rn(tl.reshape(halving_sum(tl.reshape(sq, [1, G, GROUP // 2]), LANES), [G]) / GROUP)


@triton.jit
def group_pieces(g):
    """g [G, 32] (G = 2, 4 or 8 groups) as a tuple of G pieces [G, L], L = 32 // G: piece r holds elements
    r * L .. r * L + L - 1 of each group. A group's squared errors are summed over its pieces first, element by
    element (`candidate_errors`), then over the L elements of that sum (`halving_sum`): the order in which the
    kernel summed them when each of L lanes held elements e, e + L, e + 2L, ... of a group."""
    G: tl.constexpr = g.shape[0]
    L: tl.constexpr = GROUP // G
    if G == 2:
        p0, p1 = tl.split(tl.permute(tl.reshape(g, [G, 2, L]), [0, 2, 1]))
        return p0, p1
    elif G == 4:   # element 2L a + L b + e is piece 2a + b
        a0, a1 = tl.split(tl.permute(tl.reshape(g, [G, 2, 2, L]), [0, 3, 2, 1]))
        p0, p1 = tl.split(a0)
        p2, p3 = tl.split(a1)
        return p0, p1, p2, p3
    else:          # element 4L a + 2L b + L c + e is piece 4a + 2b + c
        tl.static_assert(G == 8, "head_dim 64, 128 or 256")
        a0, a1 = tl.split(tl.permute(tl.reshape(g, [G, 2, 2, 2, L]), [0, 4, 3, 2, 1]))
        b0, b1 = tl.split(a0)
        b2, b3 = tl.split(a1)
        p0, p1 = tl.split(b0)
        p2, p3 = tl.split(b1)
        p4, p5 = tl.split(b2)
        p6, p7 = tl.split(b3)
        return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def reciprocal(s, COMPILED: tl.constexpr):
    """What `divide` multiplies by: compiled, the reciprocal approximation of s (one MUFU.RCP); else s itself."""
    if COMPILED:
        return tl.inline_asm_elementwise(asm="rcp.approx.ftz.f32 $0, $1;", constraints="=r,r", args=[s],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return s


@triton.jit
def divide(x, s, r, COMPILED: tl.constexpr):
    """x / s, s a value scale (an fp16 value > 0, or 1.0: a normal float32), r = reciprocal(s, COMPILED): bit for
    bit what `x / s` gives where the kernel runs. Compiled for the GPU, `/` on float32 is div.full.f32, which
    for such a divisor is x times the reciprocal approximation of s (its range checks on s, and the scaling of x
    they guard, never apply): with r computed once per group and scale, each element costs one multiply. The
    interpreter divides exactly, as `/` does there."""
    if COMPILED:
        return x * r
    return x / s


@triton.jit
def magnitude_key(y):
    """The bits of |y| plus the sign bit of y (uint32): for a positive midpoint t, t < |y| where y > 0 and t <= |y|
    where y <= 0 are both `bits(t) < key` (positive floats order as their bits, and t <= a is t < a + 1 ulp). A
    NaN's key is above every midpoint's."""
    u = y.to(tl.uint32, bitcast=True)
    return (u & 0x7FFFFFFF) + (u >> 31)


@triton.jit
def half_search(key, thresholds_ptr, BITS: tl.constexpr):
    """For BITS <= 4: (m, b0, b1, b2), m the number of positive midpoints (the upper half of the sorted midpoints,
    thresholds[2**(BITS-1) ..]) whose bits are below key = `magnitude_key(y)`, and its bits as booleans (unused
    ones False); by a binary search with selects among the midpoints, each a load for the whole program.

    The codebook is symmetric (`codebook.lloyd_max_codebook`: c_i == -c_{N-1-i} exactly, so the midpoints are
    too, and the middle one is 0), so the code of y, the number of midpoints below y, is 2**(BITS-1) + m where
    y > 0 and 2**(BITS-1) - 1 - m elsewhere: for y <= 0, t_i < y is -t_i > |y|, i.e. not t_k <= |y| for the
    mirrored positive t_k. The centroid is +-codebook[2**(BITS-1) + m]."""
    t = thresholds_ptr + (1 << (BITS - 1))         # the positive midpoints
    no = tl.zeros(key.shape, dtype=tl.int1)
    if BITS == 1:
        b0, b1, b2 = no, no, no
        m = tl.zeros(key.shape, dtype=tl.int32)
    elif BITS == 2:
        b0 = key > tl.load(t).to(tl.uint32, bitcast=True)
        b1, b2 = no, no
        m = b0.to(tl.int32)
    elif BITS == 3:
        b1 = key > tl.load(t + 1).to(tl.uint32, bitcast=True)
        b0 = key > tl.where(b1, tl.load(t + 2), tl.load(t)).to(tl.uint32, bitcast=True)
        b2 = no
        m = 2 * b1.to(tl.int32) + b0.to(tl.int32)
    else:
        tl.static_assert(BITS == 4, "a select search for 1 to 4 bits")
        b2 = key > tl.load(t + 3).to(tl.uint32, bitcast=True)
        b1 = key > tl.where(b2, tl.load(t + 5), tl.load(t + 1)).to(tl.uint32, bitcast=True)
        p = tl.where(b2, tl.where(b1, tl.load(t + 6), tl.load(t + 4)), tl.where(b1, tl.load(t + 2), tl.load(t)))
        b0 = key > p.to(tl.uint32, bitcast=True)
        m = 4 * b2.to(tl.int32) + 2 * b1.to(tl.int32) + b0.to(tl.int32)
    return m, b0, b1, b2


@triton.jit
def nearest_centroid(y, thresholds_ptr, BITS: tl.constexpr):
    """`codebook.nearest_centroid`: the number of sorted midpoints below y, for every float32 y (NaN: 0). Up to
    4 bits by `half_search` (no gathers), beyond by a binary search whose probes are gathered loads."""
    if BITS <= 4:
        HALF: tl.constexpr = 1 << (BITS - 1)
        m, _, _, _ = half_search(magnitude_key(y), thresholds_ptr, BITS)
        codes = tl.where(y > 0, HALF + m, HALF - 1 - m)
    else:
        codes = tl.zeros(y.shape, dtype=tl.int32)
        for step in tl.static_range(BITS):
            probe = codes + (1 << (BITS - 1 - step))
            codes = tl.where(tl.load(thresholds_ptr + probe - 1) < y, probe, codes)
    return codes


@triton.jit
def candidate_errors(pieces, rms, mult, thresholds_ptr, codebook_ptr, BITS: tl.constexpr, COMPILED: tl.constexpr):
    """(squared errors, fp16 scales), both [G, CH], BITS <= 4: each group's candidate scale rms * mult (rms [G],
    mult [CH]) and the error of its nearest-centroid codes, pieces = `group_pieces` of the rotated values; as
    `turboquant._search_value_scales` per candidate: the fp16 scale (1.0 in place of 0), x / scale to the nearest
    centroid c, sum((c * scale - x)^2).

    The arithmetic is the one-candidate-at-a-time search's (`search_scales_one_by_one`), so the errors are bit for
    bit the same: per element d = fma(c, scale, -x); per group the squares of d summed over the pieces, the first
    two as fma(d_0, d_0, d_1^2) and each further one fused, then over the L elements by `halving_sum`.

    Except that d is computed as fma(c', scale, -|x|) = +-d, which squares the same: c' = |c|, but where y = x /
    scale is +0, c' = c = -c_0 (c_0 the smallest positive centroid). Elsewhere c has the sign of y and y that of x
    (also where y is -0), so c * scale - x = sign(x) (|c| scale - |x|), rounded alike; where y is +0, x is +0 (any
    sign of c gives the same |d|) or a tiny positive x whose quotient underflowed (|d| is c_0 scale + x, which can
    round apart from c_0 scale - x where fused). So the magnitude of c is all a candidate needs: `half_search` of
    |y|'s bits plus x's sign bit (`magnitude_key`), with selects, no gathers, no signs per candidate."""
    scale16 = (rms[:, None] * mult[None, :]).to(tl.float16)
    s = scale16.to(tl.float32)
    s = tl.where(s > 0, s, 1.0)
    r = reciprocal(s, COMPILED)[:, :, None]
    s = s[:, :, None]
    G: tl.constexpr = rms.shape[0]
    HALF: tl.constexpr = 1 << (BITS - 1)
    tl.static_assert(BITS <= 4, "a select search for 1 to 4 bits")
    for p in tl.static_range(G):
        x = pieces[p][:, None, :]                                                  # [G, 1, L]
        ax = tl.abs(x)
        key = divide(ax, s, r, COMPILED).to(tl.uint32, bitcast=True) + (x.to(tl.uint32, bitcast=True) >> 31)
        _, b0, b1, b2 = half_search(key, thresholds_ptr, BITS)
        c = codebook_ptr + HALF
        if BITS == 1:
            mag = tl.zeros(key.shape, dtype=tl.float32) + tl.load(c)
        elif BITS == 2:
            mag = tl.where(b0, tl.load(c + 1), tl.load(c))
        elif BITS == 3:
            mag = pick4(b0, b1, c)
        else:
            mag = tl.where(b2, pick4(b0, b1, c + 4), pick4(b0, b1, c))
        mag = tl.where(key == 0, -tl.load(c), mag)                                # y = +0: c = -c_0 (see above)
        d = tl.fma(mag, tl.broadcast_to(s, mag.shape), tl.broadcast_to(-ax, mag.shape))
        if p == 0:
            d0 = d
        elif p == 1:
            acc = tl.fma(d0, d0, d * d)
        else:
            acc = tl.fma(d, d, acc)
    return halving_sum(acc, COMPILED), scale16


@triton.jit
def _candidate_entries(pieces, rms, idx, thresholds_ptr, codebook_ptr, multipliers_ptr, BITS: tl.constexpr,
                       NUM_MULTIPLIERS: tl.constexpr, COMPILED: tl.constexpr):
    """[G, len(idx)] (error, index, fp16 scale) of candidates idx as one int64 each, from the high bits down:
    non-negative floats order as their bits, so the least holds the first least error and its scale; errors of +inf
    or NaN (and candidates past the grid) enter as (+inf, NUM_MULTIPLIERS, scale 0)."""
    NONE: tl.constexpr = (0x7F800000 << 32) + (NUM_MULTIPLIERS << 16)
    real = idx < NUM_MULTIPLIERS
    mult = tl.load(multipliers_ptr + idx, mask=real, other=0.0)
    err, scale16 = candidate_errors(pieces, rms, mult, thresholds_ptr, codebook_ptr, BITS, COMPILED)
    entry = ((err.to(tl.int32, bitcast=True).to(tl.int64) << 32) + (idx[None, :] << 16)
             + scale16.to(tl.int16, bitcast=True).to(tl.int64))               # (a finite error's scale is >= 0)
    return tl.where(real[None, :] & (err < float("inf")), entry, NONE)


@triton.jit
def search_scales(g, thresholds_ptr, codebook_ptr, multipliers_ptr, BITS: tl.constexpr, NUM_MULTIPLIERS: tl.constexpr,
                  CANDIDATES: tl.constexpr, COMPILED: tl.constexpr):
    """(fp16 scale, found) per group of g [G, 32], BITS <= 4: the first candidate scale of least error, CANDIDATES
    candidates at a time (`candidate_errors`: [G, CANDIDATES, 32 // G] tiles with no gathers or dependent loads),
    the ones past the last full tile in a tile of the next power of two (33 candidates: 4 tiles of 8 and one of 1,
    not 5 of 8); each of the tiles' slots keeps the least (error, index) of the candidates it saw, and the least over
    the slots is the first minimum, as one candidate at a time with a strict < finds it. An error of +inf or NaN never
    wins; found is False where none did (scale 0)."""
    rms = group_rms(g, COMPILED)
    pieces = group_pieces(g)
    FULL: tl.constexpr = NUM_MULTIPLIERS // CANDIDATES
    REST: tl.constexpr = NUM_MULTIPLIERS - FULL * CANDIDATES
    tl.static_assert(FULL > 0, "at least CANDIDATES candidate scales")
    for chunk in tl.static_range(FULL):
        entry = _candidate_entries(pieces, rms, chunk * CANDIDATES + tl.arange(0, CANDIDATES), thresholds_ptr,
                                   codebook_ptr, multipliers_ptr, BITS, NUM_MULTIPLIERS, COMPILED)
        if chunk == 0:
            best = entry
        else:
            best = tl.minimum(best, entry)
    least = tl.min(best, axis=1)
    if REST > 0:
        idx = FULL * CANDIDATES + tl.arange(0, triton.next_power_of_2(REST))
        tail = _candidate_entries(pieces, rms, idx, thresholds_ptr, codebook_ptr, multipliers_ptr, BITS,
                                  NUM_MULTIPLIERS, COMPILED)
        least = tl.minimum(least, tl.min(tail, axis=1))
    return (least & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True), ((least >> 16) & 0xFFFF) < NUM_MULTIPLIERS


@triton.jit
def search_scales_one_by_one(g, thresholds_ptr, codebook_ptr, multipliers_ptr, BITS: tl.constexpr,
                             NUM_MULTIPLIERS: tl.constexpr):
    """`search_scales` for codebooks of 5 and 8 bits, one candidate at a time with a strict <, as the kernel always
    searched (only the group RMS is `group_rms` now). Their centroids take gathered loads (`nearest_centroid`), whose
    layouts the compiler then gives the error sums (`tl.sum` in-thread first); tiled, with the sums spelled out
    level by level, compiled for sm_90 the search had as many instructions as this loop, and spilled."""
    G: tl.constexpr = g.shape[0]
    g = g[None, :, :]
    rms = group_rms(tl.reshape(g, [G, GROUP]), False)[None, :]
    best_err = tl.full([1, G], float("inf"), dtype=tl.float32)
    best_scale = tl.zeros([1, G], dtype=tl.float16)
    for i in range(NUM_MULTIPLIERS):
        scale16 = (rms * tl.load(multipliers_ptr + i)).to(tl.float16)
        s = scale16.to(tl.float32)
        s = tl.where(s > 0, s, 1.0)[:, :, None]
        codes = nearest_centroid(g / s, thresholds_ptr, BITS)
        d = tl.load(codebook_ptr + codes) * s - g
        err = tl.sum(d * d, axis=2)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best_scale = tl.where(better, scale16, best_scale)
    return tl.reshape(best_scale, [G]), tl.reshape(best_err < float("inf"), [G])


@triton.jit
def encode_turboquant_values(ptr, s_ptr, thresholds_ptr, codebook_ptr, multipliers_ptr, row, s_row, x, scratch_ptr,
                             HEAD_DIM: tl.constexpr, BITS: tl.constexpr, NUM_MULTIPLIERS: tl.constexpr,
                             CANDIDATES: tl.constexpr, COMPILED: tl.constexpr):
    """Quantize one row of rotated values x [1, HEAD_DIM] float32 per group of 32 as `turboquant._encode_values`:
    for each fp16 scale rms * multiplier (in grid order), the nearest centroids of x / scale; keep the first
    scale of least squared error.

    Up to 4 bits the scales are searched CANDIDATES at a time (`search_scales`), beyond one at a time
    (`search_scales_one_by_one`); both find the same first minimum. The codes are then computed once more, for
    the chosen scales, with the search's arithmetic (codes 0 where no scale had a finite error; scale 0).

    3- and 4-bit codes reach `pack_code_nibbles` / `pack_sign_nibbles` through memory (`scratch_ptr`: this row's
    HEAD_DIM int8, stored, a barrier, loaded back): packed straight from the registers of the scale search, 3-bit
    codes in units came out wrong at head_dim 64 when compiled for an H200 (the same packing of loaded codes is
    right, and both are right under the interpreter)."""
    tl.static_assert(x.shape[0] == 1, "one row of values per program")
    G: tl.constexpr = HEAD_DIM // GROUP
    g = tl.reshape(x, [G, GROUP])
    if BITS <= 4:
        scale16, found = search_scales(g, thresholds_ptr, codebook_ptr, multipliers_ptr, BITS, NUM_MULTIPLIERS,
                                       CANDIDATES, COMPILED)
    else:
        scale16, found = search_scales_one_by_one(g, thresholds_ptr, codebook_ptr, multipliers_ptr, BITS,
                                                  NUM_MULTIPLIERS)
    s = scale16.to(tl.float32)
    s = tl.where(s > 0, s, 1.0)
    y = divide(g, s[:, None], reciprocal(s, COMPILED)[:, None], COMPILED)
    codes = tl.reshape(tl.where(found[:, None], nearest_centroid(y, thresholds_ptr, BITS), 0), [1, HEAD_DIM])
    if BITS == 3 or BITS == 4:
        offs = tl.arange(0, HEAD_DIM)
        tl.store(scratch_ptr + offs[None, :], codes.to(tl.int8))
        tl.debug_barrier()
        codes = tl.load(scratch_ptr + offs[None, :]).to(tl.int32)
        if BITS == 3:
            pack_code_nibbles(ptr, row, codes, HEAD_DIM)
        else:
            pack_sign_nibbles(ptr, row, codes, HEAD_DIM)
    else:
        pack_codes(ptr, row, codes, HEAD_DIM, BITS)
    offs_g = tl.arange(0, G)
    tl.store(s_ptr + s_row[:, None] + offs_g[None, :], tl.reshape(scale16, [1, G]))
