import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.formats.packing import pack_bits, packed_width, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("num_codes", [32, 64, 128, 256])
def test_pack_round_trips_random_codes_exactly(bits, num_codes):
    gen = torch.Generator().manual_seed(bits * 1000 + num_codes)
    codes = torch.randint(0, 1 << bits, (7, 3, num_codes), generator=gen)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (7, 3, num_codes * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, num_codes), codes)


@given(bits=st.integers(1, 8), chunks=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_pack_round_trips_any_length_that_fills_whole_bytes(bits, chunks, seed):
    num_codes = 8 * chunks
    codes = torch.randint(0, 1 << bits, (2, num_codes), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, num_codes), codes)


def test_four_bit_codes_pack_low_nibble_first():
    assert pack_bits(torch.tensor([1, 2, 15, 0]), 4).tolist() == [0x21, 0x0F]


def test_six_bit_codes_pack_four_per_three_bytes_little_endian():
    codes = torch.tensor([0b000001, 0b000010, 0b000011, 0b111111])
    word = 1 | (2 << 6) | (3 << 12) | (63 << 18)
    assert pack_bits(codes, 6).tolist() == [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]


def test_three_bit_codes_pack_eight_per_three_bytes():
    codes = torch.arange(8)
    word = sum(c << (3 * i) for i, c in enumerate(range(8)))
    assert pack_bits(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    assert packed_width(128, 3) == 48


def test_a_row_that_does_not_fill_whole_bytes_is_refused():
    with pytest.raises(AssertionError, match="whole bytes"):
        pack_bits(torch.zeros(3, dtype=torch.int64), 3)


def test_six_bit_planes_round_trip_and_keep_whole_fields_per_byte():
    from pagedkv.formats.packing import pack_planes, unpack_planes

    codes = torch.randint(0, 64, (3, 5, 64), generator=torch.Generator().manual_seed(0))
    packed = pack_planes(codes)
    assert packed.shape == (3, 5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_planes(packed, 64), codes)
    # byte j of the first plane: channels 2j (low nibble) and 2j + 1; byte u of the second: the high
    # 2 bits of channels 4u .. 4u + 3
    c = codes[0, 0]
    assert packed[0, 0, 3].item() == (c[6] & 15) | ((c[7] & 15) << 4)
    assert packed[0, 0, 32 + 2].item() == sum(((c[8 + i] >> 4).item() & 3) << (2 * i) for i in range(4))


def test_code_nibbles_round_trip_in_units_of_eight_channels():
    from pagedkv.formats.packing import pack_code_nibbles, packed_width, unpack_code_nibbles

    for n in (64, 128):
        codes = torch.randint(0, 8, (4, 3, n), generator=torch.Generator().manual_seed(n))
        packed = pack_code_nibbles(codes)
        assert packed.shape == (4, 3, packed_width(n, 3)) and packed.dtype == torch.uint8
        assert torch.equal(unpack_code_nibbles(packed, n), codes)
    # unit 3 of head_dim 128 holds channels 3, 19, .., 115: the M word's nibbles codes 0-3 (channels 3, 19, 35, 51),
    # their spare bits bit 2 of codes 4, 6, 5, 7; the N byte bits 0-1 of codes 4-7
    c = torch.zeros(128, dtype=torch.int64)
    c[3], c[19], c[3 + 16 * 4], c[3 + 16 * 6], c[3 + 16 * 7] = 5, 2, 6, 4, 3
    packed = pack_code_nibbles(c)
    m = packed[:32].view(torch.int16)
    assert [x & 0xFFFF for x in m.tolist()] == [0, 0, 0, 5 | 2 << 4 | 1 << 3 | 1 << 7] + [0] * 12
    assert packed[32 + 3].item() == (6 & 3) | (3 & 3) << 6 and packed[32:].count_nonzero().item() == 1


def test_sign_nibbles_round_trip_and_keep_the_magnitude_in_the_low_bits():
    from pagedkv.formats.packing import pack_sign_nibbles, unpack_sign_nibbles

    codes = torch.randint(0, 16, (4, 3, 128), generator=torch.Generator().manual_seed(4))
    packed = pack_sign_nibbles(codes)
    assert packed.shape == (4, 3, 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack_sign_nibbles(packed, 128), codes)
    # code 9 (magnitude index 1, positive) and code 6 (magnitude index 1, negative) differ only in bit 3;
    # field 2j in the low nibble of byte j
    assert pack_sign_nibbles(torch.tensor([9, 6, 8, 8, 8, 8, 8, 8]))[0].item() == 0x1 | (0x8 | 0x1) << 4
    # unit order: the 32-bit word u holds channels u, u + 16, .., u + 112 (head_dim 128), channel u + 16 j at bits 4j
    c = torch.full((128,), 8)
    c[3 + 16 * 5] = 15                                  # magnitude index 7, positive: unit 3, field 5
    words = pack_sign_nibbles(c).view(torch.int32)
    assert words.tolist() == [0, 0, 0, 7 << 20] + [0] * 12


def test_unit_order_puts_code_j_of_every_unit_in_one_run_of_channels():
    from pagedkv.formats.packing import channel_order, unit_order

    c = torch.arange(128).repeat(2, 1)
    u = unit_order(c)
    assert u[0, :8].tolist() == [16 * j for j in range(8)] and u[1, 8 * 5 + 3].item() == 5 + 16 * 3
    assert torch.equal(channel_order(u), c)
