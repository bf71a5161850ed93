"""The inline-PTX conversions of `ops/triton/conversions.py`, run on the CPU by a small emulator of the PTX
instructions they use.

The Triton interpreter the CPU tests run under cannot execute PTX, so the decode kernels take their plain
arithmetic branch there; this checks the PTX branch itself, bit for bit, against the codebook.
"""

import re

import numpy as np
import torch

from pagedkv.formats.codebook import lloyd_max_codebook
from pagedkv.formats.packing import pack_code_nibbles, pack_sign_nibbles
from pagedkv.ops.triton.conversions import (CODE_NIBBLES_ASM, INT8_ASM, INT8_OFFSET_ASM, INT8_PAIRS_ASM,
                                            NIBBLE_KEY_PAIRS_ASM, NIBBLE_OFFSET_ASM, NIBBLE_PAIRS_ASM, NIBBLE_QUADS_ASM, SIGN_NIBBLES_ASM,
                                            SIGN_NIBBLES_KEY_PAIRS_ASM, SIGNED_NIBBLE_SPREAD_ASM,
                                            SIX_BIT_KEY_PAIRS_ASM, SIX_BIT_QUADS_ASM, SIX_BIT_SPREAD_ASM)

M32 = 0xFFFFFFFF


def _prmt(a, b, c):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:   # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a, b, c, lut):
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _sub_f16x2(a, b):
    lanes = []
    for h in (0, 16):
        x = np.array([(a >> h) & 0xFFFF], dtype=np.uint16).view(np.float16)
        y = np.array([(b >> h) & 0xFFFF], dtype=np.uint16).view(np.float16)
        lanes.append(int((x - y).view(np.uint16)[0]))
    return lanes[0] | (lanes[1] << 16)


def _fma_f16x2(a, b, c):
    """a * b + c per float16 half, rounded once (the exact product and sum in float64, then to float16)."""
    lanes = []
    for h in (0, 16):
        x, y, z = (float(np.array([(v >> h) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]) for v in (a, b, c))
        lanes.append(int(np.array([x * y + z], dtype=np.float64).astype(np.float16).view(np.uint16)[0]))
    return lanes[0] | (lanes[1] << 16)


OPS = {
    "sub.f16x2": _sub_f16x2,
    "fma.rn.f16x2": _fma_f16x2,
    "mov.b32": lambda a: a,
    "prmt.b32": _prmt,
    "shr.b32": lambda a, n: (a & M32) >> n,
    "shl.b32": lambda a, n: (a << n) & M32,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "add.u32": lambda a, b: (a + b) & M32,
    "xor.b32": lambda a, b: a ^ b,
    "mad.lo.u32": lambda a, b, c: (a * b + c) & M32,
    "mul.lo.u32": lambda a, b: (a * b) & M32,
    "lop3.b32": _lop3,
}


def run_ptx(asm: str, inputs: list[int], num_outputs: int) -> list[int]:
    """Run `asm` (operands $0.. outputs, then inputs) on 32-bit integers; returns the outputs."""
    regs = {f"${num_outputs + i}": x & M32 for i, x in enumerate(inputs)}
    for ins in asm.replace("{", "").replace("}", "").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        assert op in OPS, f"the emulator does not know {op}"
        vals = [int(a, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", a) else regs[a] for a in args]
        regs[dst] = OPS[op](*vals) & M32
    return [regs[f"${i}"] for i in range(num_outputs)]


def _check_key_pairs(asm: str, bits: int, pack, codes: list, order: list[int]) -> None:
    """`asm` over two keys' codes packed by `pack` (one 32-bit word each) gives per output n a (first key, second
    key) pair of the centroids of channel order[n]."""
    cb_bits = lloyd_max_codebook(bits).half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    for pair_codes in codes:
        packed = pack(torch.tensor(pair_codes)).to(torch.int64)   # [2 keys, bytes]
        words = [int(sum(int(b) << (8 * i) for i, b in enumerate(row))) for row in packed]
        out = run_ptx(asm, words, 8)
        for n, pair in enumerate(out):
            for lane in range(2):
                assert (pair >> (16 * lane)) & 0xFFFF == cb_bits[pair_codes[lane, order[n]]], (n, lane, pair_codes)


def test_code_nibbles_asm_pairs_two_units_per_field_for_every_code():
    """Two units packed by `packing.pack_code_nibbles` (of two keys in the Gluon kernel, of one tile in the others)
    -> per field a (first, second) pair of centroids, fields in the order 0, 1, 2, 3, 4, 6, 5, 7."""
    rng = np.random.default_rng(7)
    codes = [rng.integers(0, 8, (2, 8)) for _ in range(400)]
    codes += [np.array([[c] * 8, [7 - c] * 8]) for c in range(8)]           # every code in every field
    codes += [np.array([np.roll(np.arange(8), r), np.arange(8)]) for r in range(8)]
    _check_key_pairs(CODE_NIBBLES_ASM.value, 3, pack_code_nibbles, codes, [0, 1, 2, 3, 4, 6, 5, 7])


def test_sign_nibbles_asm_pairs_two_keys_per_channel_for_every_code():
    """Two keys' words of eight 4-bit codes packed by `packing.pack_sign_nibbles` -> per channel a (first key,
    second key) pair of centroids, channels in the order 0, 2, 1, 3, 4, 6, 5, 7 (`decode_gluon`'s 4-bit value tiles)."""
    rng = np.random.default_rng(8)
    codes = [rng.integers(0, 16, (2, 8)) for _ in range(400)]
    codes += [np.array([[c] * 8, [15 - c] * 8]) for c in range(16)]         # every code in every channel
    _check_key_pairs(SIGN_NIBBLES_KEY_PAIRS_ASM.value, 4, pack_sign_nibbles, codes, [0, 2, 1, 3, 4, 6, 5, 7])


def test_the_emulator_knows_the_byte_permute_and_lop3():
    assert _prmt(0x33221100, 0x77665544, 0x5140) == 0x55114400
    assert _prmt(0x80000000, 0, 0x000B) & 0xFF == 0xFF          # sign-replicate of byte 3
    assert _lop3(0xF0, 0xCC, 0xAA, 0x6A) == 0x6A                # c ^ (a & b)


def _bytes(rng, n):
    edge = [0, 0xFFFFFFFF, 0x0F0F0F0F, 0xF0F0F0F0, 0x87654321, 0x78563412]
    return edge + [int(x) for x in rng.integers(0, 1 << 32, n, dtype=np.uint64)]


def _lanes(regs):
    """fp16 bit patterns of output registers, element order."""
    return [(r >> h) & 0xFFFF for r in regs for h in (0, 16)]


def test_nibble_pairs_asm_gives_both_nibbles_as_float16():
    for word in _bytes(np.random.default_rng(1), 300):
        out = run_ptx(NIBBLE_PAIRS_ASM.value, [word], 4)
        codes = [(word >> (8 * k)) & 0xFF for k in range(4)]
        want = [c & 15 for c in codes] + [c >> 4 for c in codes]
        got = np.array(_lanes(out), dtype=np.uint16).view(np.float16).astype(int).tolist()
        assert got == want, (hex(word), got, want)


def test_sign_nibbles_asm_equals_the_codebook_for_every_code():
    """One word of eight 4-bit sign nibbles -> the low nibbles' centroids (bytes 0-3), then the high ones'."""
    cb_bits = lloyd_max_codebook(4).half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    words = _bytes(np.random.default_rng(2), 300)
    words += [sum(((c + k) % 16 | ((15 - c - k) % 16) << 4) << (8 * k) for k in range(4)) for c in range(16)]
    for word in words:
        out = run_ptx(SIGN_NIBBLES_ASM.value, [word], 4)
        nibbles = [(word >> (8 * k)) & 15 for k in range(4)] + [(word >> (8 * k + 4)) & 15 for k in range(4)]
        codes = [7 - (x & 7) if x >= 8 else 8 + x for x in nibbles]
        assert _lanes(out) == [cb_bits[c] for c in codes], hex(word)


def test_signed_nibble_asms_give_the_codes_minus_seven():
    """KV-Quant 4-bit (code + 7): one word's low and high nibbles (the bytes in the order 0, 2, 1, 3), and two
    keys' words paired per channel."""
    order = [0, 2, 1, 3, 4, 6, 5, 7]
    spread = [0, 2, 1, 3]
    words = _bytes(np.random.default_rng(6), 200)
    for first, second in zip(words, words[1:] + words[:1]):
        nib = lambda w, c: ((w >> (4 * c)) & 15) - 7  # noqa: E731
        got = _f16(_lanes(run_ptx(SIGNED_NIBBLE_SPREAD_ASM.value, [first], 4)))
        assert got == [nib(first, 2 * b) for b in spread] + [nib(first, 2 * b + 1) for b in spread], hex(first)
        got = _f16(_lanes(run_ptx(NIBBLE_KEY_PAIRS_ASM.value, [first, second], 8)))
        assert got == [nib(w, order[n]) for n in range(8) for w in (first, second)], (hex(first), hex(second))


def _f16(lanes):
    return np.array(lanes, dtype=np.uint16).view(np.float16).astype(float).tolist()


def _signed8(b):
    return b - 256 if b & 0x80 else b


def test_int8_asm_gives_the_signed_codes():
    for word in _bytes(np.random.default_rng(3), 200):
        got = _f16(_lanes(run_ptx(INT8_ASM.value, [word], 2)))
        assert got == [_signed8((word >> (8 * k)) & 0xFF) for k in range(4)], hex(word)


def test_int8_offset_asm_leaves_the_codes_over_1152():
    for word in _bytes(np.random.default_rng(9), 200):
        got = _f16(_lanes(run_ptx(INT8_OFFSET_ASM.value, [word], 2)))
        assert got == [1152 + _signed8((word >> (8 * k)) & 0xFF) for k in range(4)], hex(word)


def test_nibble_offset_asm_leaves_low_nibbles_over_1024_high_over_64():
    """Bytes in the order 0, 2, 1, 3: the low nibbles as 1024 + n, then the high ones as 64 + n."""
    order = [0, 2, 1, 3]
    for word in _bytes(np.random.default_rng(10), 300):
        got = _f16(_lanes(run_ptx(NIBBLE_OFFSET_ASM.value, [word], 4)))
        byte = [(word >> (8 * k)) & 0xFF for k in order]
        assert got == [1024 + (b & 15) for b in byte] + [64 + (b >> 4) for b in byte], hex(word)

def test_int8_pairs_asm_splits_even_and_odd_channels():
    for word in _bytes(np.random.default_rng(4), 200):
        even, odd = run_ptx(INT8_PAIRS_ASM.value, [word], 2)
        units = [word & 0xFFFF, word >> 16]
        assert _f16(_lanes([even])) == [_signed8(u & 0xFF) for u in units], hex(word)
        assert _f16(_lanes([odd])) == [_signed8(u >> 8) for u in units], hex(word)


def test_nibble_quads_asm_gives_each_channel_of_a_unit():
    for word in _bytes(np.random.default_rng(5), 200):
        outs = run_ptx(NIBBLE_QUADS_ASM.value, [word], 4)
        units = [word & 0xFFFF, word >> 16]
        for i, reg in enumerate(outs):
            assert _f16(_lanes([reg])) == [((u >> (4 * i)) & 15) - 7 for u in units], (hex(word), i)


def test_six_bit_quads_asm_joins_the_two_planes():
    rng = np.random.default_rng(6)
    for word, planes in zip(_bytes(rng, 200), [int(x) for x in rng.integers(0, 1 << 16, 206)]):
        outs = run_ptx(SIX_BIT_QUADS_ASM.value, [word, planes], 4)
        units, fields = [word & 0xFFFF, word >> 16], [planes & 0xFF, planes >> 8]
        for i, reg in enumerate(outs):
            want = [((u >> (4 * i)) & 15) + 16 * ((f >> (2 * i)) & 3) - 31 for u, f in zip(units, fields)]
            assert _f16(_lanes([reg])) == want, (hex(word), hex(planes), i)


def test_six_bit_lop3_asms_give_the_codes_of_both_planes():
    """q6 (code + 31 = nibble + 16 * field): four nibble bytes beside the plane bytes of their channels (the bytes in
    the order 0, 2, 1, 3), and two keys' words with their plane halfwords paired per channel."""
    order = [0, 2, 1, 3, 4, 6, 5, 7]
    spread = [0, 2, 1, 3]
    words = _bytes(np.random.default_rng(7), 200)
    planes = [w & 0xFFFF for w in _bytes(np.random.default_rng(8), 200)]
    for first, second, pa, pb in zip(words, words[1:] + words[:1], planes, planes[::-1]):
        code = lambda w, p, c: (((w >> (4 * c)) & 15) | (((p >> (2 * c)) & 3) << 4)) - 31  # noqa: E731
        dup = (pa & 0xFF) * 0x0101 | ((pa >> 8) * 0x0101) << 16   # plane byte i >> 1 beside nibble byte i
        got = _f16(_lanes(run_ptx(SIX_BIT_SPREAD_ASM.value, [first, dup], 4)))
        assert got == [code(first, pa, 2 * i) for i in spread] + [code(first, pa, 2 * i + 1) for i in spread], hex(first)
        got = _f16(_lanes(run_ptx(SIX_BIT_KEY_PAIRS_ASM.value, [first, second, pa, pb], 8)))
        assert got == [code(w, p, order[n]) for n in range(8) for w, p in ((first, pa), (second, pb))], hex(first)
