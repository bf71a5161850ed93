"""Packed codes -> float16 in registers, one function per page layout, for the warp-split decode kernel.

Each conversion is a few integer instructions per two or four values in inline PTX (`FAST_CVT`): byte
permutes put a code under the exponent of 1024 (the float16 1024 + c), or select an entry of the fp16
codebook; under the Triton interpreter, which cannot run PTX, plain arithmetic gives the same values.
Every function is elementwise, so Triton can convert codes where the matrix units read them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.codebook import lloyd_max_codebook


def _positive_half_f16(bits: int) -> list[int]:
    """The positive half of the `bits`-bit Lloyd-Max codebook as float16 bit patterns."""
    half = lloyd_max_codebook(bits)[1 << (bits - 1):].half().view(torch.int16).to(torch.int64) & 0xFFFF
    return [int(x) for x in half]


def _f16_byte_words(entries: list[int]) -> tuple[int, int, int, int]:
    """Eight float16 bit patterns as byte tables for a byte permute indexed by the entry (a permute selects among
    8 bytes): (low bytes of entries 0-3, of 4-7, high bytes of entries 0-3, of 4-7), one byte per entry."""
    assert len(entries) == 8, "a byte permute selects among 8 bytes: tables of 8 entries"
    lo, hi = [x & 0xFF for x in entries], [x >> 8 for x in entries]
    word = lambda b: b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # noqa: E731
    return word(lo[:4]), word(lo[4:]), word(hi[:4]), word(hi[4:])


def _look_up_pairs(out0: int, out1: int) -> str:
    """Four codes in the nibbles of selector `s` (x of the first key, y of the first, x of the second, y of the
    second) looked up in the byte tables l0, l1 (low bytes) and h0, h1 (high bytes), paired into float16:
    $out0 = (x, x), $out1 = (y, y) of the (first, second) key."""
    return (f"prmt.b32 lo, l0, l1, s; prmt.b32 hi, h0, h1, s; "
            f"prmt.b32 ${out0}, lo, hi, 0x6240; prmt.b32 ${out1}, lo, hi, 0x7351;")


def _code_nibbles_asm() -> str:
    """TurboQuant 3-bit values as code nibbles (`packing.pack_code_nibbles`), two units ($8, $9: each a unit's M word
    in bits 0-15, its N byte in bits 16-23; in the Gluon kernel one unit of two keys, in the tile kernels two units
    of a tile): $0..$7 the fields 0, 1, 2, 3, 4, 6, 5, 7 as float16 pairs (first unit, second unit). The two words'
    bytes are interleaved once, so that four codes sit in the nibbles of 16 bits; each such selector (masked, or
    completed from the N bytes and the spare bits) looks its four codes up in the low-byte and the high-byte tables
    of the codebook (two byte permutes), and two more permutes pair the bytes into float16: 28 instructions for 16
    values (a magnitude plane and a sign plane took 52)."""
    codebook = [int(x) for x in lloyd_max_codebook(3).half().view(torch.int16).to(torch.int64) & 0xFFFF]
    return "\n".join([
        "{ .reg .b32 l0, l1, h0, h1, t, u, s, lo, hi;",
        "mov.b32 l0, 0x%08x; mov.b32 l1, 0x%08x; mov.b32 h0, 0x%08x; mov.b32 h1, 0x%08x;" % _f16_byte_words(codebook),
        "prmt.b32 t, $8, $9, 0x5140;",                    # M bytes: first.0, second.0, first.1, second.1
        "and.b32 s, t, 0x7777; " + _look_up_pairs(0, 1),          # codes 0, 1
        "shr.b32 s, t, 16; and.b32 s, s, 0x7777; " + _look_up_pairs(2, 3),   # codes 2, 3
        "prmt.b32 u, $8, $9, 0x0062;",                    # N bytes: first, second (bits 0-1 of codes 4..7)
        "shr.b32 s, t, 1; and.b32 s, s, 0x4444; lop3.b32 s, u, 0x3333, s, 0xEA; "   # codes 4, 6
        + _look_up_pairs(4, 5),
        "shr.b32 s, t, 17; and.b32 s, s, 0x4444; shr.b32 u, u, 2; lop3.b32 s, u, 0x3333, s, 0xEA; "
        + _look_up_pairs(6, 7),                                   # codes 5, 7
        "}"])


CODE_NIBBLES_ASM = tl.constexpr(_code_nibbles_asm())


def _code_nibbles_table_asm() -> str:
    """CODE_NIBBLES_ASM with the low-byte and high-byte tables of the codebook's entries 0-3 as operands ($10 and
    $12, `decode_gluon.code_tables`: loaded once, so they stay in two registers) instead of immediates, which the
    assembler moved into a register again before each look-up (32 moves a 16-key step of the Gluon decode)."""
    codebook = [int(x) for x in lloyd_max_codebook(3).half().view(torch.int16).to(torch.int64) & 0xFFFF]
    _, l1, _, h1 = _f16_byte_words(codebook)
    head = _code_nibbles_asm().split("\n", 2)
    return "\n".join([head[0], "mov.b32 l0, $10; mov.b32 l1, 0x%08x; mov.b32 h0, $12; mov.b32 h1, 0x%08x;" % (l1, h1),
                      head[2]])


CODE_NIBBLES_TABLE_ASM = tl.constexpr(_code_nibbles_table_asm())


# 4-bit codes, two per byte (channel 2j in the low nibble of byte j, 2j + 1 in the high one), four bytes per
# call: the low and the high nibbles, each as four float16 (two registers per output).
NIBBLE_PAIRS_ASM = tl.constexpr("""{ .reg .b32 lo, hi, b; mov.b32 b, 0x64006400;
and.b32 lo, $4, 0x0F0F0F0F; shr.b32 hi, $4, 4; and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 $0, lo, 0x64646464, 0x4140; prmt.b32 $1, lo, 0x64646464, 0x4342;
prmt.b32 $2, hi, 0x64646464, 0x4140; prmt.b32 $3, hi, 0x64646464, 0x4342;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; sub.f16x2 $2, $2, b; sub.f16x2 $3, $3, b; }""")
# Offset forms for keys with zero points (TurboQuant q8_0 / q4_0 in the Gluon kernel), no subtraction per value:
# the codes stay under the exponent and the kernel takes the offsets' share of a dot product off once per key group
# (folded into the zero point, or the start of the matrix product). int8 codes, four per call ($2): float16
# 1152 + c, bytes 0, 1 in $0, 2, 3 in $1 (three instructions for four values; INT8_ASM's five).
INT8_OFFSET_ASM = tl.constexpr("""{ .reg .b32 u; xor.b32 u, $2, 0x80808080;
prmt.b32 $0, u, 0x64646464, 0x5140; prmt.b32 $1, u, 0x64646464, 0x7362; }""")
# 4-bit codes, four bytes ($4) per call: the low nibbles under the exponent of 1024 (float16 1024 + n, bits 0-3 of
# the mantissa) in $0 (bytes 0, 2), $1 (bytes 1, 3); the high nibbles left in place under the exponent of 64
# (bits 4-7 of the mantissa: float16 64 + n) in $2 (bytes 0, 2), $3 (bytes 1, 3). Five instructions for eight
# values (NIBBLE_PAIRS_ASM's eleven); the byte order 0, 2, 1, 3 is the kernel's to name.
NIBBLE_OFFSET_ASM = tl.constexpr("""{ .reg .b32 t;
lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $2, $4, 0x00F000F0, 0x54005400, 0xEA; shr.b32 t, $4, 8;
lop3.b32 $1, t, 0x000F000F, 0x64006400, 0xEA; lop3.b32 $3, t, 0x00F000F0, 0x54005400, 0xEA; }""")

# The LOP3 form of the same conversions: `lop3 (x & 0x000F000F) | 0x64006400` turns the nibbles at bits 0 and 16 of
# x into two float16 1024 + n at once (with mask 0x00F000F0, 1024 + 16 n); one subtraction (one fused multiply-add
# by 1/16) leaves the codes. Nine instructions per four bytes instead of eleven. KV-Quant 4-bit codes (+ 7), four
# bytes ($4) per call: the low nibbles in $0, $1, the high ones in $2, $3, the bytes in the order 0, 2, 1, 3 (a
# kernel names its channels to match).
SIGNED_NIBBLE_SPREAD_ASM = tl.constexpr("""{ .reg .b32 t, m, b, h, o;
mov.b32 m, 0x64006400; mov.b32 b, 0x64076407; mov.b32 h, 0x2C002C00; mov.b32 o, 0xD470D470;
lop3.b32 $0, $4, 0x000F000F, m, 0xEA; lop3.b32 $2, $4, 0x00F000F0, m, 0xEA; shr.b32 t, $4, 8;
lop3.b32 $1, t, 0x000F000F, m, 0xEA; lop3.b32 $3, t, 0x00F000F0, m, 0xEA;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; fma.rn.f16x2 $2, $2, h, o; fma.rn.f16x2 $3, $3, h, o; }""")
# KV-Quant 4-bit codes (+ 7) of two keys' 4-byte words ($8, $9: the same eight channels of two keys): per channel a
# (first key, second key) pair of signed codes, as the matrix units read V^T; $0..$7: channels 0, 2, 1, 3, 4, 6,
# 5, 7 of the word. The two words' bytes 0, 1 (then 2, 3) side by side as (first, first, second, second), so that
# one LOP3 pairs a channel of both keys (20 instructions; a byte interleave then the PRMT form took 24).
NIBBLE_KEY_PAIRS_ASM = tl.constexpr("""{ .reg .b32 i0, i1, t, m, b, h, o;
mov.b32 m, 0x64006400; mov.b32 b, 0x64076407; mov.b32 h, 0x2C002C00; mov.b32 o, 0xD470D470;
prmt.b32 i0, $8, $9, 0x5410; prmt.b32 i1, $8, $9, 0x7632;
lop3.b32 $0, i0, 0x000F000F, m, 0xEA; lop3.b32 $2, i0, 0x00F000F0, m, 0xEA; shr.b32 t, i0, 8;
lop3.b32 $1, t, 0x000F000F, m, 0xEA; lop3.b32 $3, t, 0x00F000F0, m, 0xEA;
lop3.b32 $4, i1, 0x000F000F, m, 0xEA; lop3.b32 $6, i1, 0x00F000F0, m, 0xEA; shr.b32 t, i1, 8;
lop3.b32 $5, t, 0x000F000F, m, 0xEA; lop3.b32 $7, t, 0x00F000F0, m, 0xEA;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; fma.rn.f16x2 $2, $2, h, o; fma.rn.f16x2 $3, $3, h, o;
sub.f16x2 $4, $4, b; sub.f16x2 $5, $5, b; fma.rn.f16x2 $6, $6, h, o; fma.rn.f16x2 $7, $7, h, o; }""")


# KV-Quant q6 (code + 31 = nibble + 16 * field: the nibble plane and the 2-bit plane) in the same LOP3 form: each
# output first takes its nibbles as float16 1024 + n (1024 + 16 n for high nibbles), then its 2-bit fields OR-ed in
# as 16 * field (256 * field), then one subtraction (one fused multiply-add by 1/16) leaves the codes, exact (at most
# 2,032 before it). Four nibble bytes ($4) and, byte i beside nibble byte i, the plane byte that holds its two
# channels' fields (bits 4 (i & 1) .. + 3, so bytes P0, P0, P1, P1: $5) per call; outputs as
# SIGNED_NIBBLE_SPREAD_ASM: the low nibbles' channels in $0, $1, the high ones' in $2, $3, bytes in the order 0, 2,
# 1, 3.
SIX_BIT_SPREAD_ASM = tl.constexpr("""{ .reg .b32 t, f, m, b, h, o;
mov.b32 m, 0x64006400; mov.b32 b, 0x641F641F; mov.b32 h, 0x2C002C00; mov.b32 o, 0xD5F0D5F0;
shr.b32 t, $4, 8;
lop3.b32 $0, $4, 0x000F000F, m, 0xEA; shl.b32 f, $5, 4; lop3.b32 $0, f, 0x00300030, $0, 0xEA;
lop3.b32 $1, t, 0x000F000F, m, 0xEA; shr.b32 f, $5, 8; lop3.b32 $1, f, 0x00300030, $1, 0xEA;
lop3.b32 $2, $4, 0x00F000F0, m, 0xEA; shl.b32 f, $5, 6; lop3.b32 $2, f, 0x03000300, $2, 0xEA;
lop3.b32 $3, t, 0x00F000F0, m, 0xEA; shr.b32 f, $5, 6; lop3.b32 $3, f, 0x03000300, $3, 0xEA;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; fma.rn.f16x2 $2, $2, h, o; fma.rn.f16x2 $3, $3, h, o; }""")
# q6 values of two keys paired per channel, as NIBBLE_KEY_PAIRS_ASM: nibble words $8, $9 (the same eight channels of
# two keys), their 2-bit plane halfwords (channel c at bits 2c) zero-extended in $10, $11; $0..$7: channels 0, 2,
# 1, 3, 4, 6, 5, 7 of the word, each a (first key, second key) pair of codes.
SIX_BIT_KEY_PAIRS_ASM = tl.constexpr("""{ .reg .b32 i0, i1, t0, t1, p, f, m, b, h, o;
mov.b32 m, 0x64006400; mov.b32 b, 0x641F641F; mov.b32 h, 0x2C002C00; mov.b32 o, 0xD5F0D5F0;
prmt.b32 i0, $8, $9, 0x5410; prmt.b32 i1, $8, $9, 0x7632; prmt.b32 p, $10, $11, 0x5410;
shr.b32 t0, i0, 8; shr.b32 t1, i1, 8;
lop3.b32 $0, i0, 0x000F000F, m, 0xEA; shl.b32 f, p, 4; lop3.b32 $0, f, 0x00300030, $0, 0xEA;
lop3.b32 $2, i0, 0x00F000F0, m, 0xEA; shl.b32 f, p, 6; lop3.b32 $2, f, 0x03000300, $2, 0xEA;
lop3.b32 $1, t0, 0x000F000F, m, 0xEA; lop3.b32 $1, p, 0x00300030, $1, 0xEA;
lop3.b32 $3, t0, 0x00F000F0, m, 0xEA; shl.b32 f, p, 2; lop3.b32 $3, f, 0x03000300, $3, 0xEA;
lop3.b32 $4, i1, 0x000F000F, m, 0xEA; shr.b32 f, p, 4; lop3.b32 $4, f, 0x00300030, $4, 0xEA;
lop3.b32 $6, i1, 0x00F000F0, m, 0xEA; shr.b32 f, p, 2; lop3.b32 $6, f, 0x03000300, $6, 0xEA;
lop3.b32 $5, t1, 0x000F000F, m, 0xEA; shr.b32 f, p, 8; lop3.b32 $5, f, 0x00300030, $5, 0xEA;
lop3.b32 $7, t1, 0x00F000F0, m, 0xEA; shr.b32 f, p, 6; lop3.b32 $7, f, 0x03000300, $7, 0xEA;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; fma.rn.f16x2 $2, $2, h, o; fma.rn.f16x2 $3, $3, h, o;
sub.f16x2 $4, $4, b; sub.f16x2 $5, $5, b; fma.rn.f16x2 $6, $6, h, o; fma.rn.f16x2 $7, $7, h, o; }""")


def _positive_half_f16_byte_words(bits: int = 4) -> tuple[int, int, int, int]:
    """The positive half of the codebook in float16 as byte tables (`_f16_byte_words`)."""
    return _f16_byte_words(_positive_half_f16(bits))


def _sign_nibble_lines(src: str, outs: tuple[int, int, int, int]) -> list[str]:
    """Sign nibbles (magnitude index in bits 0-2, sign in bit 3) of the four bytes in register `src`, as float16
    pairs: $outs[0] = the low nibbles of bytes 0, 1, $outs[1] = their high nibbles, $outs[2], $outs[3] the same of
    bytes 2, 3. The magnitudes of four values are a byte-permute selector as they are (masked), looked up in the
    low- and high-byte tables of the codebook's positive half and paired into float16 (four permutes); each pair's
    two sign bits are moved under bits 15 and 31 by one more permute and applied with one LOP3."""
    x0, x1, x2, x3 = outs
    return [f"shl.b32 t, {src}, 4; and.b32 s, {src}, 0x7777; " + _look_up_pairs(x0, x1),
            f"shr.b32 s, {src}, 16; and.b32 s, s, 0x7777; " + _look_up_pairs(x2, x3),
            f"prmt.b32 w, t, 0, 0x1000; lop3.b32 ${x0}, w, 0x80008000, ${x0}, 0x6A;",        # low nibbles' signs
            f"prmt.b32 w, {src}, 0, 0x1000; lop3.b32 ${x1}, w, 0x80008000, ${x1}, 0x6A;",     # high nibbles'
            f"prmt.b32 w, t, 0, 0x3020; lop3.b32 ${x2}, w, 0x80008000, ${x2}, 0x6A;",
            f"prmt.b32 w, {src}, 0, 0x3020; lop3.b32 ${x3}, w, 0x80008000, ${x3}, 0x6A;"]


_SIGN_NIBBLE_REGS = ("{ .reg .b32 l0, l1, h0, h1, t, s, w, lo, hi, i0, i1;\n"
                     "mov.b32 l0, 0x%08x; mov.b32 l1, 0x%08x; mov.b32 h0, 0x%08x; mov.b32 h1, 0x%08x;"
                     % _positive_half_f16_byte_words(4))
# TurboQuant 4-bit values as sign nibbles, four bytes ($4) per call: the low nibbles' centroids in $0 (bytes 0, 1),
# $1 (bytes 2, 3), the high ones' in $2, $3 (23 instructions for 8 values).
SIGN_NIBBLES_ASM = tl.constexpr("\n".join([_SIGN_NIBBLE_REGS, *_sign_nibble_lines("$4", (0, 2, 1, 3)), "}"]))


def _sign_nibbles_key_pairs_asm() -> str:
    """TurboQuant 4-bit values as sign nibbles (`packing.pack_sign_nibbles`), two keys' 4-byte words ($8, $9: the
    same unit of two keys): $0..$7 the fields 0, 2, 1, 3, 4, 6, 5, 7 of the word as (first key, second key) pairs,
    as the matrix units read V^T. The words' bytes are interleaved (byte b of both side by side), then
    `_sign_nibble_lines` on each interleaved word: 46 instructions for 16 values (sorted codes' look-ups took 90)."""
    return "\n".join([_SIGN_NIBBLE_REGS, "prmt.b32 i0, $8, $9, 0x5140; prmt.b32 i1, $8, $9, 0x7362;",
                      *_sign_nibble_lines("i0", (0, 2, 1, 3)), *_sign_nibble_lines("i1", (4, 6, 5, 7)), "}"])


SIGN_NIBBLES_KEY_PAIRS_ASM = tl.constexpr(_sign_nibbles_key_pairs_asm())


# int8 codes, four per call ($2): the bytes c ^ 0x80 under the exponent of 1024 read 1152 + c; minus 1152.
INT8_ASM = tl.constexpr("""{ .reg .b32 u, b; xor.b32 u, $2, 0x80808080; mov.b32 b, 0x64806480;
prmt.b32 $0, u, 0x64646464, 0x5140; prmt.b32 $1, u, 0x64646464, 0x7362;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; }""")
# int16 units of two int8 codes, two units per call ($2): even channels in $0, odd ones in $1.
INT8_PAIRS_ASM = tl.constexpr("""{ .reg .b32 u, b; xor.b32 u, $2, 0x80808080; mov.b32 b, 0x64806480;
prmt.b32 $0, u, 0x64646464, 0x4240; prmt.b32 $1, u, 0x64646464, 0x4341;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; }""")
# int16 units of four (code + 7) nibbles, two units per call ($4): channel 4j + i of both units in $i.
NIBBLE_QUADS_ASM = tl.constexpr("""{ .reg .b32 lo, hi, b; mov.b32 b, 0x64076407;
and.b32 lo, $4, 0x0F0F0F0F; shr.b32 hi, $4, 4; and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 $0, lo, 0x64646464, 0x4240; prmt.b32 $1, hi, 0x64646464, 0x4240;
prmt.b32 $2, lo, 0x64646464, 0x4341; prmt.b32 $3, hi, 0x64646464, 0x4341;
sub.f16x2 $0, $0, b; sub.f16x2 $1, $1, b; sub.f16x2 $2, $2, b; sub.f16x2 $3, $3, b; }""")
# q6: the nibble units ($4) and their 2-bit plane bytes ($5), two units per call: code + 31 = nibble + 16 * field.
SIX_BIT_QUADS_ASM = tl.constexpr("""{ .reg .b32 lo, hi, t, a, b, m;
and.b32 lo, $4, 0x0F0F0F0F; shr.b32 hi, $4, 4; and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, $5, 0, 0x1100;
and.b32 a, t, 0x00030003; shr.b32 b, t, 4; and.b32 b, b, 0x03000300; or.b32 a, a, b; shl.b32 a, a, 4;
add.u32 lo, lo, a;
shr.b32 a, t, 2; and.b32 a, a, 0x00030003; shr.b32 b, t, 6; and.b32 b, b, 0x03000300; or.b32 a, a, b;
shl.b32 a, a, 4; add.u32 hi, hi, a;
mov.b32 m, 0x641F641F;
prmt.b32 $0, lo, 0x64646464, 0x4240; prmt.b32 $1, hi, 0x64646464, 0x4240;
prmt.b32 $2, lo, 0x64646464, 0x4341; prmt.b32 $3, hi, 0x64646464, 0x4341;
sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; sub.f16x2 $2, $2, m; sub.f16x2 $3, $3, m; }""")


@triton.jit
def int8_to_f16(c, FAST_CVT: tl.constexpr):
    """int8 codes -> float16, exact: the bytes c ^ 0x80 put under the exponent of 1024 read 1152 + c."""
    if FAST_CVT:
        return tl.inline_asm_elementwise(asm=INT8_ASM, constraints="=r,=r,r", args=[c], dtype=tl.float16,
                                         is_pure=True, pack=4)
    return c.to(tl.float16)


@triton.jit
def int8_pairs_to_f16(x, FAST_CVT: tl.constexpr):
    """int16 holding two int8 codes (channel 2j low byte, 2j + 1 high byte) -> (even, odd) as float16, exact."""
    if FAST_CVT:
        return tl.inline_asm_elementwise(asm=INT8_PAIRS_ASM, constraints="=r,=r,r", args=[x],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    x = x.to(tl.int32)
    return ((x << 24) >> 24).to(tl.float16), (x >> 8).to(tl.float16)


@triton.jit
def nibble_quads_to_f16(x, FAST_CVT: tl.constexpr):
    """int16 holding four (code + 7) nibbles (channel 4j + i at bits 4i) -> four float16 codes, exact."""
    if FAST_CVT:
        return tl.inline_asm_elementwise(asm=NIBBLE_QUADS_ASM, constraints="=r,=r,=r,=r,r", args=[x],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    x = x.to(tl.int32)
    return (((x & 15) - 7).to(tl.float16), (((x >> 4) & 15) - 7).to(tl.float16),
            (((x >> 8) & 15) - 7).to(tl.float16), (((x >> 12) & 15) - 7).to(tl.float16))


@triton.jit
def six_bit_quads_to_f16(x, h, FAST_CVT: tl.constexpr):
    """q6 codes of four channels from their two planes (`packing.pack_planes`): x int16 holding the low
    nibbles of channels 4u..4u+3, h uint8 holding their high 2-bit fields -> four float16 codes, exact."""
    if FAST_CVT:
        return tl.inline_asm_elementwise(asm=SIX_BIT_QUADS_ASM, constraints="=r,=r,=r,=r,r,r", args=[x, h],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    x = x.to(tl.int32) & 0xFFFF
    h = h.to(tl.int32)
    return (((x & 15) + 16 * (h & 3) - 31).to(tl.float16), (((x >> 4) & 15) + 16 * ((h >> 2) & 3) - 31).to(tl.float16),
            (((x >> 8) & 15) + 16 * ((h >> 4) & 3) - 31).to(tl.float16), (((x >> 12) & 15) + 16 * (h >> 6) - 31).to(tl.float16))


@triton.jit
def code_nibble(m, n, cb_ptr, J: tl.constexpr):
    """The centroid of field J of TurboQuant 3-bit code-nibble units (plain arithmetic): M word m, N byte n."""
    if J < 4:
        code = (m >> (4 * J)) & 7
    else:
        k: tl.constexpr = 2 * ((J - 4) % 2) + (J - 4) // 2   # the nibble whose spare bit holds bit 2 of field J
        code = ((n >> (2 * (J - 4))) & 3) | (((m >> (4 * k + 3)) & 1) << 2)
    return tl.load(cb_ptr + code)


@triton.jit
def code_nibbles_to_f16(units, bytes_n, cb_ptr, FAST_CVT: tl.constexpr):
    """TurboQuant 3-bit values in units (`packing.pack_code_nibbles`): units int16 (the M words), bytes_n uint8 (the
    N bytes) -> eight tensors of centroids, field j in the j-th (with FAST_CVT float16 by byte permutes over the
    fp16 codebook, CODE_NIBBLES_ASM; otherwise loads from the codebook, in its dtype)."""
    if FAST_CVT:
        # one operand per unit (M and N in one int32): Triton then reads the units straight into the matrix
        # units' layout, where a second loaded operand made it stage the values through shared memory
        both = (units.to(tl.int32) & 0xFFFF) | (bytes_n.to(tl.int32) << 16)
        f = tl.inline_asm_elementwise(asm=CODE_NIBBLES_ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[both],
                                      dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        values = (f[0], f[1], f[2], f[3], f[4], f[6], f[5], f[7])
    else:
        m = units.to(tl.int32) & 0xFFFF
        n = bytes_n.to(tl.int32)
        values = (code_nibble(m, n, cb_ptr, 0), code_nibble(m, n, cb_ptr, 1), code_nibble(m, n, cb_ptr, 2),
                  code_nibble(m, n, cb_ptr, 3), code_nibble(m, n, cb_ptr, 4), code_nibble(m, n, cb_ptr, 5),
                  code_nibble(m, n, cb_ptr, 6), code_nibble(m, n, cb_ptr, 7))
    return values


@triton.jit
def nibble_pairs_to_f16(b, FAST_CVT: tl.constexpr):
    """uint8 holding two 4-bit codes -> (low nibble, high nibble) as float16, exact."""
    if FAST_CVT:
        return tl.inline_asm_elementwise(asm=NIBBLE_PAIRS_ASM, constraints="=r,=r,=r,=r,r", args=[b],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    x = b.to(tl.int32)
    return (x & 15).to(tl.float16), ((x >> 4) & 15).to(tl.float16)


@triton.jit
def sign_nibble(x, cb_ptr):
    """The centroid of a TurboQuant 4-bit sign nibble x (plain arithmetic)."""
    return tl.load(cb_ptr + tl.where(x >= 8, 7 - (x & 7), 8 + (x & 7)))


@triton.jit
def sign_nibble_pairs_to_f16(b, cb_ptr, FAST_CVT: tl.constexpr):
    """uint8 holding two TurboQuant 4-bit values as sign nibbles (`packing.pack_sign_nibbles`) -> their centroids
    (low nibble's, high nibble's): with FAST_CVT float16 by byte permutes over the positive half of the fp16
    codebook (SIGN_NIBBLES_ASM), else loads from the codebook in its dtype."""
    if FAST_CVT:
        return tl.inline_asm_elementwise(asm=SIGN_NIBBLES_ASM, constraints="=r,=r,=r,=r,r", args=[b],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    x = b.to(tl.int32)
    return sign_nibble(x & 15, cb_ptr), sign_nibble((x >> 4) & 15, cb_ptr)
