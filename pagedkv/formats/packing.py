"""Bit packing shared by the quantized formats: b-bit codes <-> a little-endian bitstream of bytes.

Code `i` of a row occupies bits `[i * b, (i + 1) * b)` of the row's bitstream, least significant bit
first; byte `j` holds bits `[8 j, 8 j + 8)`. So 4-bit codes go two per byte (low nibble first), 6-bit
codes four per three bytes, 3-bit codes eight per three bytes.

`pack_planes` stores 6-bit codes as two planes instead (the same bytes): the low 4 bits of every code as
a 4-bit stream, then the high 2 bits as a 2-bit stream. Every byte then holds whole fields of 2 or 4
codes, which the decode kernels unpack with masks alone (KV-Quant q6).

TurboQuant's 3- and 4-bit values index a symmetric sorted codebook, and both go in unit order: field 8u + j
holds channel u + j * n / 8, so unit u holds eight channels n / 8 apart, and field j of every unit together is
the contiguous run of channels [j * n / 8, (j + 1) * n / 8) (one scale group of 32 at head_dim 128).
`pack_code_nibbles` stores 3-bit codes so that each is its own look-up selector (a 16-bit word of four codes in
nibbles, whose spare bits hold the high bits of the other four, and a byte of those four codes' low bits: the
bytes of a 3-bit stream); `pack_sign_nibbles` stores 4-bit codes as a magnitude index (bits 0-2) and a sign (bit
3), 4-bit fields as `pack_bits` packs them. The decode kernels then turn codes into float16 by byte permutes
over the codebook's bytes.
"""

from __future__ import annotations

import math

import torch


def packed_width(num_codes: int, bits: int) -> int:
    """Bytes that `num_codes` codes of `bits` bits take (the row must fill whole bytes)."""
    assert 1 <= bits <= 8, f"codes of {bits} bits cannot be packed into bytes"
    assert (num_codes * bits) % 8 == 0, f"{num_codes} codes of {bits} bits do not fill whole bytes"
    return num_codes * bits // 8


def _chunk(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest run of codes that ends on a byte boundary."""
    num_bytes = math.lcm(bits, 8) // 8
    return num_bytes * 8 // bits, num_bytes


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., n] integers in [0, 2**bits) -> [..., n * bits / 8] uint8."""
    n = codes.shape[-1]
    width = packed_width(n, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    per_chunk, chunk_bytes = _chunk(bits)
    # [..., chunks, per_chunk] -> one integer of at most 40 bits per chunk
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], n // per_chunk, per_chunk)
    shifts = torch.arange(per_chunk, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(dim=-1, keepdim=True)
    byte_shifts = torch.arange(chunk_bytes, device=codes.device, dtype=torch.int64) * 8
    out = (word >> byte_shifts) & 0xFF
    return out.reshape(*codes.shape[:-1], width).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """packed: [..., num_codes * bits / 8] uint8 -> [..., num_codes] int64 codes in [0, 2**bits)."""
    width = packed_width(num_codes, bits)
    assert packed.shape[-1] == width, f"expected {width} bytes per row, got {packed.shape[-1]}"
    if bits == 8:
        return packed.to(torch.int64)
    per_chunk, chunk_bytes = _chunk(bits)
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], num_codes // per_chunk, chunk_bytes)
    byte_shifts = torch.arange(chunk_bytes, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(dim=-1, keepdim=True)
    shifts = torch.arange(per_chunk, device=packed.device, dtype=torch.int64) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], num_codes)


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """6-bit codes [..., n] in [0, 64) -> [..., 3n / 4] uint8: low nibbles (n / 2 bytes), then high 2-bit fields."""
    c = codes.to(torch.int64)
    return torch.cat([pack_bits(c & 15, 4), pack_bits(c >> 4, 2)], dim=-1)


def unpack_planes(packed: torch.Tensor, num_codes: int) -> torch.Tensor:
    """The inverse of `pack_planes`: [..., 3n / 4] uint8 -> [..., n] int64 codes in [0, 64)."""
    assert packed.shape[-1] == packed_width(num_codes, 6), f"expected {packed_width(num_codes, 6)} bytes per row"
    lo = unpack_bits(packed[..., :num_codes // 2], 4, num_codes)
    hi = unpack_bits(packed[..., num_codes // 2:], 2, num_codes)
    return lo | (hi << 4)


def unit_order(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] (n a multiple of 8) in unit order: unit u (the 8 codes at 8u .. 8u + 7) holds channels
    u + (n / 8) j, j = 0..7, so that code j of every unit lies in one run of n / 8 channels."""
    n = codes.shape[-1]
    return codes.reshape(*codes.shape[:-1], 8, n // 8).transpose(-1, -2).reshape(codes.shape)


def channel_order(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of `unit_order`."""
    n = codes.shape[-1]
    return codes.reshape(*codes.shape[:-1], n // 8, 8).transpose(-1, -2).reshape(codes.shape)


# 3-bit codes as code nibbles, in units (unit u: channels u + (n / 8) j, j = 0..7), each as a 16-bit word M and a
# byte N. Nibble k of M (k = 0..3) holds code k (bits 0-2) and, in its spare bit 3,
# bit 2 of code NIBBLE_HIGH_BITS[k]; N holds bits 0-1 of codes 4..7 (code 4 + i at bits 2i). The M words go first
# (n / 4 bytes), then the N bytes (n / 8): 3n / 8 bytes per row, as a 3-bit stream. A decode then looks every code
# up as it is (a byte permute over the codebook's bytes).
NIBBLE_HIGH_BITS = (4, 6, 5, 7)


def pack_code_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] in [0, 8) -> [..., 3n / 8] uint8 as code nibbles (above)."""
    n = codes.shape[-1]
    c = unit_order(codes.to(torch.int64)).reshape(*codes.shape[:-1], n // 8, 8)   # [..., units, 8]
    k = torch.arange(4, device=codes.device, dtype=torch.int64)
    high = c[..., list(NIBBLE_HIGH_BITS)] >> 2
    m = ((c[..., :4] & 7) << (4 * k)).sum(-1) | (high << (4 * k + 3)).sum(-1)          # [..., units]
    nb = ((c[..., 4:] & 3) << (2 * k)).sum(-1)
    m_bytes = torch.stack([m & 0xFF, m >> 8], dim=-1).flatten(-2)
    return torch.cat([m_bytes, nb], dim=-1).to(torch.uint8)


def unpack_code_nibbles(packed: torch.Tensor, num_codes: int) -> torch.Tensor:
    """The inverse of `pack_code_nibbles`: [..., 3n / 8] uint8 -> [..., n] int64 codes in [0, 8)."""
    assert packed.shape[-1] == packed_width(num_codes, 3), f"expected {packed_width(num_codes, 3)} bytes per row"
    units = num_codes // 8
    b = packed.to(torch.int64)
    m = b[..., 0:2 * units:2] | (b[..., 1:2 * units:2] << 8)                        # [..., units]
    nb = b[..., 2 * units:]
    k = torch.arange(4, device=packed.device, dtype=torch.int64)
    low = (m[..., None] >> (4 * k)) & 7                                             # codes 0..3
    rest = (nb[..., None] >> (2 * k)) & 3                                           # bits 0-1 of codes 4..7
    high = (m[..., None] >> (4 * k + 3)) & 1                                        # bit 2 of NIBBLE_HIGH_BITS[k]
    rest = rest | (high[..., [NIBBLE_HIGH_BITS.index(4 + i) for i in range(4)]] << 2)
    c = torch.cat([low, rest], dim=-1)                                              # [..., units, 8]
    return channel_order(c.reshape(*packed.shape[:-1], num_codes))


# 4-bit codes of a symmetric sorted codebook as sign nibbles, in unit order: code c -> magnitude index (c - 8, or
# 7 - c below 8) in bits 0-2 and the sign (c < 8) in bit 3, packed as `pack_bits` packs 4-bit codes (so the 32-bit
# word u holds unit u, field j at bits 4j). A decode looks the magnitude up in the codebook's positive half (a byte
# permute over eight entries) and sets the sign bit.
def pack_sign_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] in [0, 16) -> [..., n / 2] uint8 as sign nibbles in unit order (above)."""
    c = unit_order(codes.to(torch.int64))
    negative = c < 8
    return pack_bits(torch.where(negative, 7 - c, c - 8) | (negative.to(torch.int64) << 3), 4)


def unpack_sign_nibbles(packed: torch.Tensor, num_codes: int) -> torch.Tensor:
    """The inverse of `pack_sign_nibbles`: [..., n / 2] uint8 -> [..., n] int64 codes in [0, 16)."""
    nib = unpack_bits(packed, 4, num_codes)
    m = nib & 7
    return channel_order(torch.where(nib >= 8, 7 - m, 8 + m))
