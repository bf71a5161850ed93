"""Shape-only launch decisions: split-K fills the GPU for few long sequences, and evens out the waves
of a batch that overflows one wave by a little."""

import torch

from pagedkv.ops.triton.tuning import CTAS_PER_SM, MAX_SPLITS, splits_for


def test_no_split_when_programs_fill_whole_waves():
    assert splits_for(CTAS_PER_SM["dense"] * 132, 8192, 132, CTAS_PER_SM["dense"]) == 1
    assert splits_for(64 * 8, 8192, 132, CTAS_PER_SM["dense"]) == 1      # 512 programs, one wave of 528
    assert splits_for(2 * 3 * 132, 8192, 132, 3) == 1                     # exactly two waves


def test_one_long_sequence_is_split_by_its_capacity():
    # 8 KV heads of one 32k-token sequence: 32 splits of 1024 keys
    assert splits_for(8, 32768, 132) == 32
    # a longer one: as many splits as fill one wave (396 resident programs), at most MAX_SPLITS
    s = splits_for(8, 1 << 20, 132, 3)
    assert 8 * s <= 396 < 8 * (s + 1) and s <= MAX_SPLITS


def test_short_capacity_is_not_split():
    assert splits_for(8, 1000, 132) == 1


def test_a_mostly_idle_last_wave_is_split_away():
    # q8 pages at batch 64: 512 programs, 396 resident; one full wave and one 29% full. Split in three:
    # 1,536 shorter programs in 4 waves, 97% full (measured on an H200: 1.6x faster with 2 splits)
    assert splits_for(64 * 8, 8192, 132, 3) == 3
    # dense pages at batch 32: 256 programs fill half a wave; two splits fill it
    assert splits_for(32 * 8, 4096, 132, CTAS_PER_SM["dense"]) == 2


def test_quantized_pages_get_enough_programs_per_multiprocessor():
    from pagedkv.ops.triton.tuning import QUANTIZED_PROGRAMS_PER_SM as per_sm

    for programs, capacity, splits in [(64 * 8, 8192, 3), (128 * 8, 2048, 2), (32 * 8, 4096, 4), (8, 32768, 32)]:
        assert splits_for(programs, capacity, 132, 2, per_sm) == splits
    assert splits_for(4 * 132 * 8, 8192, 132, 2, per_sm) == 1


def test_prefill_is_never_split_and_keeps_its_128_row_tiles(monkeypatch):
    """A 512-token chunk of one sequence fills few programs, but splitting it would put it on 16-row
    decode tiles that read every key once per 4 tokens (measured: TurboQuant prefill many times slower)."""
    from types import SimpleNamespace

    import torch

    from pagedkv.ops.triton import tuning

    monkeypatch.setattr(tuning, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for kind, bits in [("dense", 16), ("turboquant", 3), ("kvquant", 8)]:
        fmt = SimpleNamespace(spec=SimpleNamespace(kind=kind), bits=bits, num_kv_heads=8)
        splits, tiles = tuning.plan_attention(512, 1, 4, 128, fmt, 32768, cuda)
        assert splits == 1 and tiles.block_m == 128
        splits, tiles = tuning.plan_attention(1, 1, 4, 128, fmt, 32768, cuda)   # one decode token: split
        assert splits == 32 and tiles.block_m == 16


def test_float32_queries_get_32_keys_a_step_on_a_gpu():
    """Their products run on the CUDA cores with operands in registers (`tuning.FLOAT32_TILE_N`); 16-bit queries
    keep the matrix-unit tiles."""
    from pagedkv.ops.triton.tuning import TileConfig, choose_tiles, split_tiles

    cuda = torch.device("cuda", 0)
    assert choose_tiles(2048, 1, 4, 128, cuda, dtype=torch.float32) == TileConfig(32, 32, 8, 2)      # prefill
    assert choose_tiles(2048, 1, 4, 128, cuda, dtype=torch.bfloat16) == TileConfig(128, 128, 8, 2)
    assert choose_tiles(8, 8, 4, 128, cuda, pages="packed", dtype=torch.float32) == TileConfig(16, 32, 4, 2)
    assert choose_tiles(8, 8, 4, 128, cuda, pages="packed", dtype=torch.float16) == TileConfig(16, 128, 4, 2)
    assert split_tiles(4, 128, "packed", 4, dtype=torch.float32) == TileConfig(16, 32, 4, 2)
    assert split_tiles(4, 128, "packed", 4, dtype=torch.bfloat16) == TileConfig(16, 128, 4, 2)


def test_tiles_step_down_until_they_fit_the_gpu_and_the_fit_is_remembered():
    """A GPU with less shared memory than the tiles need (Triton raises OutOfResources at launch) gets
    smaller tiles: fewer stages first, then fewer keys per step; the fit is remembered for later calls."""
    import pytest
    from triton.runtime.errors import OutOfResources

    from pagedkv.ops.triton.tuning import _fitted, launch_fitting
    from pagedkv.ops.triton.tuning import TileConfig

    def smem(t):  # a stand-in for the kernels' shared memory, bytes
        return t.tile_n * 128 * 2 * 2 * max(1, t.num_stages - 1) + t.block_m * 128 * 2

    launched = []

    def launch(t):
        launched.append(t)
        if smem(t) > 48 * 1024:
            raise OutOfResources(smem(t), 48 * 1024, "shared memory")
        return t

    key = ("varlen", "test-device", "bf16", "off", 128)
    start = TileConfig(128, 128, 8, 5)
    with pytest.warns(RuntimeWarning, match="need more than this GPU has"):
        fitted = launch_fitting(launch, start, 4, key)
    assert launched[0] == start and smem(fitted) <= 48 * 1024
    assert fitted == TileConfig(128, 32, 8, 2)                    # 5 -> 2 stages, then 128 -> 64 -> 32 keys
    assert launched[1] == TileConfig(128, 128, 8, 2)              # stages go first
    launched.clear()
    assert launch_fitting(launch, start, 4, key) == fitted and launched == [fitted]   # remembered, no retries
    _fitted.clear()


def test_tiles_that_can_shrink_no_further_raise():
    import pytest
    from triton.runtime.errors import OutOfResources

    from pagedkv.ops.triton.tuning import _fitted, launch_fitting
    from pagedkv.ops.triton.tuning import TileConfig

    def launch(t):
        raise OutOfResources(1 << 20, 1024, "shared memory")

    with pytest.raises(OutOfResources), pytest.warns(RuntimeWarning):
        launch_fitting(launch, TileConfig(16, 64, 4, 5), 4, ("split", "test-device", "bf16", "off", 128))
    _fitted.clear()


def test_first_use_of_kernels_is_announced_once_per_format_and_dtype(capsys, monkeypatch):
    import torch

    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops import triton as triton_ops

    # A fresh process's state: another test in this worker may already have run q4's kernels.
    monkeypatch.setattr(triton_ops, "_announced", set())
    fmt = make_format(KVFormat.parse("q4"), 2, 64, torch.float32, "cpu")
    for _ in range(2):
        assert triton_ops.announced("decode", fmt, torch.bfloat16, lambda: 7) == 7
    triton_ops.announced("prefill", fmt, torch.bfloat16, lambda: None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert "decode kernels for q4 pages (bfloat16)" in lines[0] and "compiled on first use" in lines[0]
    assert "prefill kernels" in lines[1]


def test_warp_split_decode_splits_fill_the_resident_slots(monkeypatch):
    """Splits only when the programs fill at most half of the resident slots, then as many as fill them."""
    from pagedkv.ops.triton import tuning

    monkeypatch.setattr(tuning, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # one-warp programs, 16 per SM (the default): about 2,048 programs at every shape
    assert tuning.warp_split_splits(512, 8192, cuda, programs_per_sm=16) == 4     # batch 64 x 8 KV heads
    assert tuning.warp_split_splits(256, 4096, cuda, programs_per_sm=16) == 8     # batch 32
    assert tuning.warp_split_splits(1024, 2048, cuda, programs_per_sm=16) == 2    # batch 128
    assert tuning.warp_split_splits(2048, 2048, cuda, programs_per_sm=16) == 1    # full already
    assert tuning.warp_split_splits(8, 32768, cuda, programs_per_sm=16) == 256    # one long sequence
    assert tuning.warp_split_splits(8, 2048, cuda, programs_per_sm=16) == 16      # at least 128 keys per split
    assert tuning.warp_split_splits(256, 4096, cuda, programs_per_sm=4) == 2      # four-warp programs, 4 per SM
    assert tuning.warp_split_splits(512, 8192, cuda, programs_per_sm=4) == 1
    assert tuning.warp_split_splits(8, 32768, torch.device("cpu"), programs_per_sm=4) == 1
