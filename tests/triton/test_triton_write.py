"""The Triton cache-write kernel against `reference.write_kv`: the same page bytes, padding skipped."""

import pytest
import torch

from pagedkv.formats import hadamard
from pagedkv.formats.base import read_slots, write_slots
from pagedkv.ops import reference
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.triton import kv_write
from triton_cases import DEVICE, build_case

FORMATS = ["off", "q8", "q6", "q4", "q4:rotate_keys", "q8:rotate_keys", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant:k=q5_0,v=q2_0",
           "turboquant:k=int2,v=q8_0"]


def poisoned_like(pages):
    return {n: p.clone().fill_(float("nan")) if p.dtype.is_floating_point else p.clone().fill_(-1)
            for n, p in pages.items()}


def assert_same_pages(got, want, fmt, keys=None, values=None, slots=None):
    """Byte-equal pages, except where a format rotates: the rotation is a float product whose summation
    order the format leaves open (and the value-scale search sums 32 squares), so there the kernel's
    pages must keep the format's guarantees instead: rotated keys decode within scale / 2, and each value
    group reconstructs the rotated values as well as the reference's choice does."""
    rotated_keys = getattr(fmt, "key_rotation", None) is not None
    rotated = ({"v", "v_scale"} if fmt.spec.kind == "turboquant" else set()) | \
        ({"k", "k_scale", "k_zero"} if rotated_keys else set())
    for name in want:
        a, b = got[name], want[name]
        same = (a == b) | (a.isnan() & b.isnan()) if a.dtype.is_floating_point else a == b
        if name in rotated:
            continue
        assert bool(same.all()), f"{name}: {(~same).sum().item()} of {same.numel()} entries differ"
    parts = lambda pages: {n: read_slots(p, slots) for n, p in pages.items()}  # noqa: E731
    if fmt.spec.kind == "kvquant" and rotated_keys:   # one scale per token and head: absmax / qmax
        got_scale, want_scale = parts(got)["k_scale"], parts(want)["k_scale"]
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-5, atol=0)
        k_got, _ = fmt.decode_for_attention(parts(got))
        x_keys = keys.float() @ fmt.key_rotation
        assert bool(((k_got - x_keys).abs() <= got_scale / 2 * (1 + 1e-4) + 1e-6).all()), "a rotated key decodes too far"
    if fmt.spec.kind != "turboquant":
        return
    k_got, v_got = fmt.decode_for_attention(parts(got))
    _, v_want = fmt.decode_for_attention(parts(want))
    x_values = values.float() @ fmt.value_rotation
    err = lambda v: (v.double() - x_values.double()).pow(2).reshape(*v.shape[:-1], -1, 32).sum(-1)  # noqa: E731
    assert bool((err(v_got) <= err(v_want) * (1 + 1e-5) + 1e-12).all()), "a value group is reconstructed worse"
    if fmt.key_rotation is not None:
        got_scale, want_scale = parts(got)["k_scale"], parts(want)["k_scale"]
        ulps = (got_scale.view(torch.int16).int() - want_scale.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, "a key scale is off by more than one fp16 step"
        assert float((parts(got)["k_zero"].float() - parts(want)["k_zero"].float()).abs().max()) <= 1
        x_keys = keys.float() @ fmt.key_rotation
        half_step = parts(got)["k_scale"].float().repeat_interleave(32, dim=-1) / 2
        assert bool(((k_got - x_keys).abs() <= half_step * (1 + 1e-4) + 1e-6).all()), "a rotated key decodes too far"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_matches_reference(fmt, head_dim):
    case = build_case(5, fmt, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=4,
                      ctx_lens=[0, 0, 0], new_lens=[5, 1, 10])
    pages = poisoned_like(case.pages)
    kv_write.write_kv(pages, case.fmt, case.keys, case.values, case.write_meta)
    assert_same_pages(pages, case.pages, case.fmt, case.keys, case.values, case.write_meta.slot_mapping)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_skips_padding_slots(fmt):
    case = build_case(6, fmt, num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=4,
                      ctx_lens=[0, 0], new_lens=[3, 6])
    # a padded [2, 6] input grid: row 0 has 3 real tokens and 3 padding positions
    n0, n1 = 3, 6
    keys = torch.randn(2 * n1, 2, 64, device=DEVICE)
    values = torch.randn(2 * n1, 2, 64, device=DEVICE)
    real = torch.tensor([i for i in range(n0)] + [n1 + i for i in range(n1)], device=DEVICE)
    keys[real] = case.keys
    values[real] = case.values
    slots = torch.full((2 * n1,), -1, dtype=torch.int64, device=DEVICE)
    slots[real] = case.write_meta.slot_mapping
    meta = AttentionMetadata(case.write_meta.block_table, case.write_meta.seq_lens, case.write_meta.query_start_loc,
                             slots, real, case.write_meta.seq_lens_cpu, case.write_meta.query_start_loc_cpu, 4)
    pages = poisoned_like(case.pages)
    kv_write.write_kv(pages, case.fmt, keys, values, meta)
    assert_same_pages(pages, case.pages, case.fmt, case.keys, case.values, case.write_meta.slot_mapping)


def turboquant_values(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """Values for the value-scale search's corner cases, one kind of row per token (cycling): Gaussian rows of
    several magnitudes, an all-zero row, a row whose first group (32 channels) is zero, rows with two nonzero
    channels (after the rotation half their channels are exactly 0 and the rest share one magnitude: ties
    between candidate scales), a row of -0.0 and a row with one nonzero channel."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v *= torch.exp2(torch.randint(-6, 7, (num_tokens, num_kv_heads, 1), generator=gen).float())
    for t in range(num_tokens):
        kind = t % 8
        if kind == 1:
            v[t] = 0.0
        elif kind == 2:
            v[t, :, :32] = 0.0
        elif kind in (3, 4):
            v[t] = 0.0
            v[t, :, (3 * t) % head_dim] = 0.75
            v[t, :, (5 * t + 7) % head_dim] = 0.75 if kind == 3 else -1.5
        elif kind == 5:
            v[t] = -0.0
        elif kind == 6:
            v[t] = 0.0
            v[t, :, t % head_dim] = 2.0
    return v


@pytest.mark.skipif(DEVICE.type == "cuda", reason="bit for bit only under the interpreter, which divides "
                    "exactly and fuses nothing, as the reference's PyTorch operations do; compiled, the write "
                    "divides and fuses as the GPU does (`codecs.divide`), and test_write_matches_reference holds "
                    "its pages to the format's guarantees instead")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fmt", ["turboquant", "turboquant:k=q4_0,v=q4_0"])
def test_turboquant_pages_are_the_reference_pages_bit_for_bit(fmt, head_dim):
    """Every TurboQuant page tensor (codes and fp16 scales of keys and values) equal to the reference's, values with
    zeros and ties included, in a padded batch (negative slots skipped)."""
    case = build_case(7, fmt, num_q_heads=2, num_kv_heads=2, head_dim=head_dim, block_size=4,
                      ctx_lens=[0, 0], new_lens=[9, 7])
    n = case.keys.shape[0]
    values = turboquant_values(n, 2, head_dim, seed=head_dim)
    padded = 2 * n
    real = torch.arange(0, padded, 2, device=DEVICE)                  # every other input position is padding
    keys = torch.randn(padded, 2, head_dim, device=DEVICE)
    vals = torch.randn(padded, 2, head_dim, device=DEVICE)
    keys[real], vals[real] = case.keys, values.to(DEVICE)
    slots = torch.full((padded,), -1, dtype=torch.int64, device=DEVICE)
    slots[real] = case.write_meta.slot_mapping
    meta = AttentionMetadata(case.write_meta.block_table, case.write_meta.seq_lens, case.write_meta.query_start_loc,
                             slots, None, case.write_meta.seq_lens_cpu, case.write_meta.query_start_loc_cpu, 4)
    want = poisoned_like(case.pages)
    reference.write_kv(want, case.fmt, case.keys, values.to(DEVICE), case.write_meta)
    # The reference rotates values by a matrix product, the kernel by butterflies (`hadamard.rotate`): at head_dim
    # 64 (entries +-1/8) both are exact here; at 128 they round differently (a channel the butterflies make 0 can
    # come out 1e-9), so the values' pages are the reference's scale search and packing of the butterflies' rotation.
    fmt_ = case.fmt
    x = hadamard.rotate(values.to(DEVICE).float(), fmt_.value_signs)
    codes, scale = fmt_._search_value_scales(x.reshape(n, 2, head_dim // 32, 32))
    rotated = {"v": fmt_._pack_values(codes.reshape(x.shape)), "v_scale": scale}
    for name, part in rotated.items():
        if head_dim == 64:
            assert torch.equal(read_slots(want[name], case.write_meta.slot_mapping), part.to(want[name].dtype))
        write_slots(want[name], case.write_meta.slot_mapping, part)
    got = poisoned_like(case.pages)
    kv_write.write_kv(got, case.fmt, keys, vals, meta)
    for name in want:
        a, b = got[name], want[name]
        if name == "k_zero":   # by value: the kernel rounds (hi + lo) / (2 scale) in (-0.5, 0) to +0, PyTorch to -0
            a, b = a.nan_to_num(7.0), b.nan_to_num(7.0)
        elif a.dtype.is_floating_point:                               # bits (the NaN-poisoned slots compare too)
            a, b = a.view(torch.int16), b.view(torch.int16)
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} entries differ"
