"""The warp-split decode kernel (`ops/triton/decode.py`) against the reference, for the formats it reads.

Run compiled on CUDA, else under the Triton interpreter (conftest.py), where the codes are converted
with plain arithmetic instead of inline PTX (same values).
"""

import dataclasses

import pytest
import torch

from pagedkv.config import KVFormat
from pagedkv.formats import make_format
from pagedkv.ops import reference
from pagedkv.ops.triton import decode
from pagedkv.ops.triton.tuning import warp_split_tiles
from triton_cases import DEVICE, build_case, rel_err

FORMATS = ["off", "q8", "q6", "q4", "q4:rotate_keys"]
# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 4 and 8; head_dim 64 and 128
SHAPES = [(2, 2, 64, 16), (8, 2, 128, 16), (8, 1, 64, 5)]
# decode tokens, a verify-like run of 3 and a prefill chunk in one batch, one sequence without new tokens
CTX_LENS = [0, 37, 70, 20, 9]
NEW_LENS = [5, 1, 3, 1, 0]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def tiles_of(fmt, transposed):
    """The format's default config, in the given orientation (both kernels read every supported format)."""
    return dataclasses.replace(warp_split_tiles(fmt), transposed=transposed)


@pytest.mark.parametrize("transposed", [False, True], ids=["heads_m", "keys_m"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_matches_reference(fmt, shape, num_splits, transposed):
    hq, hkv, d, bs = shape
    case = build_case(hash((fmt, shape)) % 1000, fmt, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    scale = d ** -0.5
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale, num_splits=num_splits,
                                 tiles=tiles_of(case.fmt, transposed))
    assert rel_err(out, ref) < TOL[torch.float32]


TQ_SHAPES = [(8, 2, 128, 16), (4, 4, 128, 16), (8, 1, 128, 5)]   # TurboQuant: head_dim 128 only


# The default TurboQuant pages in both orientations; those only the transposed kernel reads (q4_0 keys, 4-bit
# values), and rotated keys
TQ_SPECS = ["turboquant", "turboquant:k=q4_0,v=q4_0", "turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant:k=q8_0,v=q4_0",
            "turboquant:k=q4_0,v=q3_0", "turboquant:k=q8_0,v=q3_0,rotate_keys"]
TQ_CASES = [("turboquant", False)] + [(spec, True) for spec in TQ_SPECS]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", TQ_SHAPES, ids=lambda s: "q{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("spec,transposed", TQ_CASES, ids=lambda c: {False: "heads_m", True: "keys_m"}.get(c, c))
def test_decode_kernel_matches_reference_over_turboquant_pages(spec, transposed, shape, num_splits):
    hq, hkv, d, bs = shape
    case = build_case(hash(shape) % 1000 + TQ_SPECS.index(spec), spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      block_size=bs, ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5, num_splits=num_splits,
                                 tiles=tiles_of(case.fmt, transposed))
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("options", [dict(sliding_window=7), dict(softcap=3.0), dict(sliding_window=40, softcap=2.0)],
                         ids=["window", "softcap", "window_softcap"])
@pytest.mark.parametrize("fmt", ["off", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys"])
def test_decode_window_and_softcap_match_reference(fmt, options, num_splits):
    case = build_case(7, fmt, num_q_heads=8, num_kv_heads=2, head_dim=128 if fmt.startswith("turboquant") else 64, block_size=16,
                      ctx_lens=[0, 161, 3], new_lens=[2, 1, 1])
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.3, **options)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.3, num_splits=num_splits,
                                 **options)
    assert rel_err(out, ref) < TOL[torch.float32]


DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS + ["turboquant"])
def test_decode_kernel_16_bit_queries(fmt, dtype):
    case = build_case(11, fmt, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                      ctx_lens=[90, 33], new_lens=[1, 1], dtype=dtype)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.1)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.1, num_splits=2)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_kernel_reads_only_the_formats_it_supports():
    def fmt(spec, head_dim=64):
        return make_format(KVFormat.parse(spec), 2, head_dim, torch.float32, "cpu")

    assert [decode.is_supported(fmt(s)) for s in ["off", "q8", "q6", "q4"]] == [True, True, True, True]
    assert decode.is_supported(fmt("turboquant", 128))
    assert not decode.is_supported(fmt("turboquant", 64))            # eight-channel value units: head_dim 128
    assert decode.is_supported(fmt("turboquant:k=q8_0,v=q3_0,rotate_keys", 128))   # the queries are rotated
    assert decode.is_supported(fmt("turboquant:k=q4_0,v=q4_0", 128))
    assert not decode.is_supported(fmt("turboquant:k=q4_0,v=q4_0", 128), transposed=False)
    assert not decode.is_supported(fmt("turboquant:k=q5_0,v=q2_0", 128))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fmt", ["q8", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0"])
def test_transposed_kernel_with_several_warps_per_program_matches_reference(fmt, num_splits):
    """The default programs are one warp; the kernel also splits a program's keys over warps (steps of
    WARPS x TILE_N keys, merged at the end)."""
    hq, hkv, d, bs = (8, 2, 128, 16) if fmt.startswith("turboquant") else (8, 1, 64, 5)
    case = build_case(11 + num_splits, fmt, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5)
    tiles = dataclasses.replace(warp_split_tiles(case.fmt), num_warps=4, programs_per_sm=4)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5, num_splits=num_splits,
                                 tiles=tiles)
    assert rel_err(out, ref) < TOL[torch.float32]




def test_turboquant_scale_pages_must_be_aligned():
    """The transposed kernel reads a slot's four group scales as one 8-byte word: scale pages whose slots are not
    8-byte aligned are refused with a clear error instead of a misaligned read on the GPU."""
    case = build_case(5, "turboquant", num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                      ctx_lens=[20], new_lens=[1])
    pages = dict(case.pages)
    wide = torch.zeros(*pages["v_scale"].shape[:-1], 5, dtype=pages["v_scale"].dtype, device=pages["v_scale"].device)
    wide[..., 1:] = pages["v_scale"]
    pages["v_scale"] = wide[..., 1:]                  # same values, 10-byte slots
    with pytest.raises(ValueError, match="8-byte aligned"):
        decode.paged_attention(case.query, pages, case.fmt, case.meta, scale=0.1, tiles=warp_split_tiles(case.fmt))
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.1, tiles=warp_split_tiles(case.fmt))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("transposed", [False, True], ids=["heads_m", "keys_m"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fmt", ["q8", "q4", "turboquant"])
def test_decode_kernel_launched_in_any_token_order_matches_reference(fmt, num_splits, transposed):
    """A token order in the metadata (`metadata.LONGEST_FIRST`'s; here a random one) only changes which programs
    start first (`decode_io.launch_grid`: grid (heads, splits, tokens) over it): the reference's outputs."""
    hq, hkv, d, bs = SHAPES[1]
    case = build_case(7, fmt, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    n = case.query.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(torch.int32).to(DEVICE)
    meta = dataclasses.replace(case.meta, token_order=order)
    out = decode.paged_attention(case.query, case.pages, case.fmt, meta, scale=0.125, num_splits=num_splits,
                                 tiles=tiles_of(case.fmt, transposed))
    assert rel_err(out, ref) < TOL[case.query.dtype]
    # and each token's row is its own: the same order reversed gives the same rows
    back = decode.paged_attention(case.query, case.pages, case.fmt, dataclasses.replace(meta, token_order=order.flip(0)),
                                  scale=0.125, num_splits=num_splits, tiles=tiles_of(case.fmt, transposed))
    assert torch.equal(out, back)
