import math

import pytest
import torch

from pagedkv import ConfigError, KVFormat
from pagedkv.formats import make_format
from pagedkv.formats.codebook import lloyd_max_codebook
from pagedkv.formats.hadamard import fwht, random_signs, rotate, unrotate
from pagedkv.formats.turboquant import SCALE_GRID

KEY_QUANTS = ["q8_0", "int8", "q5_0", "q4_0", "int4", "int2"]
VALUE_QUANTS = {"q2_0": 2, "q3_0": 3, "q4_0": 4, "q5_0": 5, "q8_0": 8}
# E[(x - q(x))^2] of the Lloyd–Max quantizer of N(0, 1) (Max, 1960)
LLOYD_MAX_DISTORTION = {2: 0.1175, 3: 0.03454, 4: 0.009497, 5: 0.002499}


def turbo(spec="turboquant", head_dim=64, heads=3):
    return make_format(KVFormat.parse(spec), heads, head_dim, torch.float32, "cpu")


def keys_like(n=200, heads=3, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, head_dim, generator=gen) * torch.rand(n, heads, 1, generator=gen) * 4
    x[:, :, 5] += 12  # an outlier channel, as RoPE'd keys have
    return x + torch.randn(1, heads, head_dim, generator=gen)  # a per-channel offset


def test_three_bit_codebook_matches_the_published_lloyd_max_levels():
    expected = torch.tensor([-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520])
    torch.testing.assert_close(lloyd_max_codebook(3), expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_each_centroid_is_the_mean_of_its_cell(bits):
    c = lloyd_max_codebook(bits).double()
    assert torch.equal(c, -c.flip(0)) and bool((c[1:] > c[:-1]).all())
    t = (c[1:] + c[:-1]) / 2
    lo = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), t])
    hi = torch.cat([t, torch.tensor([math.inf], dtype=torch.float64)])
    pdf = lambda x: torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # noqa: E731
    mean = (pdf(lo) - pdf(hi)) / (torch.special.ndtr(hi) - torch.special.ndtr(lo))
    torch.testing.assert_close(c, mean, atol=1e-4 if bits == 8 else 1e-6, rtol=0)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_hadamard_rotation_is_the_signed_sylvester_matrix_and_orthogonal(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = random_signs(n, 7).double()
    x = torch.randn(5, n, dtype=torch.float64)
    torch.testing.assert_close(fwht(x), x @ h.T)
    torch.testing.assert_close(rotate(x, signs), (x * signs) @ h.T / math.sqrt(n))
    torch.testing.assert_close(unrotate(rotate(x, signs), signs), x)
    torch.testing.assert_close(rotate(x, signs).norm(dim=-1), x.norm(dim=-1))


def test_signs_are_fixed_by_the_seed():
    assert torch.equal(random_signs(64, 3), random_signs(64, 3))
    assert not torch.equal(random_signs(64, 3), random_signs(64, 4))


@pytest.mark.parametrize("k_quant", KEY_QUANTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_key_error_is_at_most_half_a_step_of_its_group(k_quant, head_dim):
    fmt = turbo(f"turboquant:k={k_quant},v=q3_0", head_dim)
    k = keys_like(head_dim=head_dim)
    parts = fmt.encode(k, k)
    assert parts["k_scale"].dtype == parts["k_zero"].dtype == torch.float16
    assert parts["k_scale"].shape == (200, 3, head_dim // 32)
    assert torch.equal(parts["k_zero"].float(), parts["k_zero"].float().round())
    step = parts["k_scale"].float().repeat_interleave(32, dim=-1)
    k2, _ = fmt.decode(parts)
    assert bool(((k - k2).abs() <= step / 2 + 1e-6 * k.abs()).all())


@pytest.mark.parametrize("k_quant, levels", [("q8_0", 254), ("q5_0", 31), ("q4_0", 15), ("int2", 3)])
def test_key_scale_is_the_group_range_over_the_levels_rounded_up_to_fp16(k_quant, levels):
    fmt = turbo(f"turboquant:k={k_quant},v=q3_0")
    k = keys_like()
    g = k.reshape(200, 3, 2, 32)
    exact = (g.amax(-1) - g.amin(-1)) / levels
    scale = fmt.encode(k, k)["k_scale"].float()
    assert bool((scale >= exact).all())
    assert bool((scale <= exact * (1 + 2 ** -10)).all())


def test_q8_0_zero_point_centres_the_group():
    fmt = turbo("turboquant:k=q8_0,v=q3_0")
    k = keys_like()
    parts = fmt.encode(k, k)
    g = k.reshape(200, 3, 2, 32)
    s = parts["k_scale"].float()
    torch.testing.assert_close(parts["k_zero"].float(), torch.round((g.amax(-1) + g.amin(-1)) / (2 * s)))
    codes = parts["k"].int()
    assert codes.dtype == torch.int32 and int(codes.max()) <= 127 and int(codes.min()) >= -127


def test_constant_and_zero_key_groups_decode_exactly_enough():
    fmt = turbo("turboquant:k=q4_0,v=q3_0")
    k = torch.zeros(2, 3, 64)
    k[1] = 3.25
    k2, _ = fmt.decode(fmt.encode(k, k))
    torch.testing.assert_close(k2, k, atol=3.25 / 1024, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotated_keys_keep_scores_and_their_error_is_bounded_in_the_rotated_domain(head_dim):
    fmt = turbo("turboquant:k=q4_0,v=q4_0,rotate_keys", head_dim)
    k = keys_like(head_dim=head_dim)
    parts = fmt.encode(k, k)
    k_rot, _ = fmt.decode_for_attention(parts)
    step = parts["k_scale"].float().repeat_interleave(32, dim=-1)
    assert bool(((rotate(k, fmt.key_signs) - k_rot).abs() <= step / 2 + 1e-5).all())
    k2, _ = fmt.decode(parts)
    q = torch.randn(200, 3, head_dim)
    torch.testing.assert_close((fmt.attention_query(q) * k_rot).sum(-1), (q * k2).sum(-1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("v_quant", list(VALUE_QUANTS))
def test_value_error_is_nearest_centroid_error_in_the_rotated_domain(v_quant):
    bits = VALUE_QUANTS[v_quant]
    fmt = turbo(f"turboquant:k=q8_0,v={v_quant}", 128)
    v = torch.randn(100, 3, 128) * torch.rand(100, 3, 1) * 5
    parts = fmt.encode(v, v)
    _, v_rot_hat = fmt.decode_for_attention(parts)
    x = rotate(v, fmt.value_signs)
    c = lloyd_max_codebook(bits)
    s = parts["v_scale"].float().repeat_interleave(32, dim=-1)
    half_gap = float((c[1:] - c[:-1]).max()) / 2
    bound = s * torch.clamp(x.abs() / s - float(c[-1]), min=half_gap)
    assert bool(((x - v_rot_hat).abs() <= bound * (1 + 1e-5) + 1e-6).all())
    # the rotation is orthogonal: the error is the same in the model's domain
    _, v2 = fmt.decode(parts)
    torch.testing.assert_close((v - v2).norm(dim=-1), (x - v_rot_hat).norm(dim=-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_value_mse_of_gaussian_data_is_below_the_lloyd_max_distortion(bits):
    fmt = turbo(f"turboquant:k=q8_0,v=q{bits}_0", 64, heads=1)
    v = torch.randn(4000, 1, 64, generator=torch.Generator().manual_seed(bits))
    _, v2 = fmt.decode(fmt.encode(v, v))
    mse = float((v - v2).pow(2).mean())
    assert 0.5 * LLOYD_MAX_DISTORTION[bits] < mse < LLOYD_MAX_DISTORTION[bits]


def test_value_scale_is_the_best_multiple_of_the_rms_on_the_grid():
    fmt = turbo("turboquant:k=q8_0,v=q3_0", 64, heads=1)
    v = torch.randn(50, 1, 64, generator=torch.Generator().manual_seed(5))
    parts = fmt.encode(v, v)
    x = rotate(v, fmt.value_signs).reshape(50, 1, 2, 32)
    rms = x.pow(2).mean(-1).sqrt()
    c = fmt.codebook
    _, v_rot = fmt.decode_for_attention(parts)
    err = (v_rot.reshape(50, 1, 2, 32) - x).pow(2).sum(-1)
    for m in SCALE_GRID:
        s = (rms * m).half().float()[..., None]
        alt = c[torch.bucketize(x / s, (c[1:] + c[:-1]) / 2)] * s
        assert bool((err <= (alt - x).pow(2).sum(-1) + 1e-6).all())


def test_bytes_per_token_per_head_at_head_dim_128():
    assert turbo("turboquant", 128).bytes_per_token_per_head() == 200  # 128 + 8 + 8 keys, 48 + 8 values
    assert turbo("turboquant:k=q4_0,v=q4_0", 128).bytes_per_token_per_head() == 64 + 16 + 64 + 8
    assert all(name[0] in "kv" for name in turbo().page_spec())


@pytest.mark.parametrize("head_dim", [32, 80, 96, 512])
def test_unsupported_head_dims_are_refused_with_the_accepted_ones(head_dim):
    with pytest.raises(ConfigError, match=f"head_dim 64, 128 or 256.*{head_dim}"):
        turbo("turboquant", head_dim)
