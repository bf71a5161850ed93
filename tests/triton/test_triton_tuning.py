"""Shape-only launch decisions: split-K fills about two waves for few long sequences, never otherwise."""

from pagedkv.ops.triton.tuning import CTAS_PER_SM, MAX_SPLITS, splits_for


def test_no_split_when_programs_fill_a_wave():
    assert splits_for(CTAS_PER_SM * 132, 8192, 132) == 1
    assert splits_for(64 * 8, 8192, 132) == 1


def test_one_long_sequence_is_split_by_its_capacity():
    # 8 KV heads of one 32k-token sequence: 32 splits of 1024 keys
    assert splits_for(8, 32768, 132) == 32
    assert splits_for(8, 1 << 20, 132) == MAX_SPLITS


def test_short_capacity_is_not_split():
    assert splits_for(8, 1000, 132) == 1
    assert splits_for(32 * 8, 4096, 132) == 4
