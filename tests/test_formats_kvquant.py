import pytest
import torch

from pagedkv import ConfigError, KVFormat
from pagedkv.formats import make_format
from pagedkv.formats.kvquant import KVQuantFormat

QMAX = {"q8": 127, "q6": 31, "q4": 7}


def kvquant(mode, head_dim=64, heads=3, dtype=torch.float32):
    return make_format(KVFormat.parse(mode), heads, head_dim, dtype, "cpu")


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_reconstruction_error_is_at_most_half_a_step(mode):
    fmt = kvquant(mode)
    gen = torch.Generator().manual_seed(1)
    # a spread of magnitudes, with outliers, as keys and values have
    k = torch.randn(300, 3, 64, generator=gen) * torch.rand(300, 3, 1, generator=gen) * 8
    v = torch.randn(300, 3, 64, generator=gen) ** 3
    parts = fmt.encode(k, v)
    k2, v2 = fmt.decode(parts)
    for x, x2, scale in ((k, k2, parts["k_scale"]), (v, v2, parts["v_scale"])):
        expected_scale = (x.abs().amax(-1, keepdim=True) / QMAX[mode]).clamp_min(1e-6)
        torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
        assert bool(((x - x2).abs() <= scale / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_codes_stay_within_qmax_and_the_absmax_element_is_exact(mode):
    fmt = kvquant(mode)
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(2))
    k2, _ = fmt.decode(fmt.encode(x, x))
    idx = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(k2.gather(-1, idx), x.gather(-1, idx), rtol=1e-6, atol=0)


def test_all_zero_vectors_use_the_minimum_scale_and_decode_to_zero():
    fmt = kvquant("q4")
    z = torch.zeros(4, 3, 64)
    parts = fmt.encode(z, z)
    assert bool((parts["k_scale"] == 1e-6).all())
    k, v = fmt.decode(parts)
    assert not k.any() and not v.any()


def test_q8_stores_int8_codes_and_q6_q4_pack_them():
    spec = {m: kvquant(m, head_dim=128).page_spec() for m in QMAX}
    assert spec["q8"]["k"] == (128, torch.int8)
    assert spec["q6"]["k"] == (96, torch.uint8)
    assert spec["q4"]["v"] == (64, torch.uint8)
    assert spec["q8"]["k_scale"] == (1, torch.float32)


@pytest.mark.parametrize("mode, expected", [("q8", 264), ("q6", 200), ("q4", 136)])
def test_bytes_per_token_per_head_at_head_dim_128(mode, expected):
    assert kvquant(mode, head_dim=128).bytes_per_token_per_head() == expected


def test_decode_returns_the_model_dtype_and_the_mirror_dtype_comes_from_the_config():
    fmt = make_format(KVFormat.from_seed_configs(None, {"mode": "q6", "dtype": "fp16"}), 2, 64, torch.float32, "cpu")
    assert isinstance(fmt, KVQuantFormat)
    assert fmt.mirror_dtype == torch.float16
    k, v = fmt.decode(fmt.encode(torch.randn(3, 2, 64), torch.randn(3, 2, 64)))
    assert k.dtype == v.dtype == torch.float32


def test_q6_needs_a_head_dim_that_fills_whole_bytes():
    with pytest.raises(ConfigError, match="head_dim 6"):
        kvquant("q6", head_dim=6)


def test_format_fingerprint_changes_with_the_page_layout():
    """Pages saved in an older byte layout (before q6 planes) must not match today's format identity."""
    from pagedkv.identity import format_fingerprint

    fmt = kvquant("q6")
    before = format_fingerprint(fmt)
    fmt.page_layout = "1"
    assert format_fingerprint(fmt) != before
