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


# rotate_keys: keys rotated by TurboQuant's key rotation before quantization -----------------------------------

@pytest.mark.parametrize("spec, mode, recent", [("q4:rotate_keys", "q4", 0), ("q8:rotate_keys", "q8", 0),
                                                 ("q4:rotate_keys,recent_tokens=128", "q4", 128),
                                                 ("Q6: rotate_keys", "q6", 0)])
def test_format_string_rotate_keys_parses_and_prints_back(spec, mode, recent):
    fmt = KVFormat.parse(spec)
    assert (fmt.kind, fmt.mode, fmt.rotate_keys, fmt.recent_tokens) == ("kvquant", mode, True, recent)
    assert KVFormat.parse(str(fmt)) == fmt
    assert str(fmt.page_format) == f"{mode}:rotate_keys"
    assert fmt != KVFormat.parse(mode) and str(KVFormat.parse(mode)) == mode


@pytest.mark.parametrize("spec, message", [("q4:k=q4_0", "bad KV-Quant option 'k=q4_0'.*q4 takes rotate_keys"),
                                           ("q4:rotate_keys=1", "bad KV-Quant option 'rotate_keys=1'"),
                                           ("off:rotate_keys", "unknown page format")])
def test_bad_kvquant_options_name_what_is_accepted(spec, message):
    with pytest.raises(ConfigError, match=message):
        KVFormat.parse(spec)


def test_rotate_keys_on_dense_pages_is_refused():
    with pytest.raises(ConfigError, match="rotate_keys needs a quantized format"):
        KVFormat(rotate_keys=True)


def test_rotate_keys_needs_a_power_of_two_head_dim():
    with pytest.raises(ConfigError, match="power-of-two head_dim.*head_dim 96"):
        kvquant("q4:rotate_keys", head_dim=96)
    assert kvquant("q4", head_dim=96).key_rotation is None


def test_rotated_keys_are_the_turboquant_rotation_then_kvquant_codes():
    fmt = kvquant("q4:rotate_keys")
    turboquant = kvquant("turboquant:k=q4_0,v=q4_0,rotate_keys")
    torch.testing.assert_close(fmt.key_rotation, turboquant.key_rotation, rtol=0, atol=0)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(20, 3, 64, generator=gen), torch.randn(20, 3, 64, generator=gen)
    parts, plain = fmt.encode(k, v), kvquant("q4").encode(k @ turboquant.key_rotation, v)
    for name in ("k", "k_scale", "v", "v_scale"):
        torch.testing.assert_close(parts[name], plain[name], rtol=0, atol=0)
    assert fmt.bytes_per_token_per_head() == kvquant("q4").bytes_per_token_per_head() == 72


def test_rotate_keys_round_trip_lowers_the_error_of_outlier_channels():
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(300, 3, 64, generator=gen)
    k[..., 5] *= 30   # one outlier channel sets the per-token scale of plain q4
    v = torch.randn(300, 3, 64, generator=gen)
    rotated, plain = kvquant("q4:rotate_keys"), kvquant("q4")
    k_rot, v_rot = rotated.decode(rotated.encode(k, v))
    k_plain, v_plain = plain.decode(plain.encode(k, v))
    torch.testing.assert_close(v_rot, v_plain, rtol=0, atol=0)   # values are not rotated
    err_rot, err_plain = (k_rot - k).pow(2).mean(), (k_plain - k).pow(2).mean()
    assert err_rot < err_plain / 4, (err_rot, err_plain)
    # decode gives keys in the model's domain; decode_for_attention keeps them rotated, queries follow
    k_att, v_att = rotated.decode_for_attention(rotated.encode(k, v))
    q = torch.randn(7, 3, 64, generator=gen)
    torch.testing.assert_close(torch.einsum("qhd,khd->qhk", rotated.attention_query(q).float(), k_att),
                               torch.einsum("qhd,khd->qhk", q, k_rot.float()), rtol=1e-4, atol=1e-3)


def test_rotate_keys_changes_the_format_fingerprint():
    from pagedkv.identity import format_fingerprint

    assert format_fingerprint(kvquant("q4:rotate_keys")) != format_fingerprint(kvquant("q4"))
