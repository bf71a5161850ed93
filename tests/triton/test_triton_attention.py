"""The Triton attention kernels (varlen and split-K) against the reference, for every page format.

Run compiled on CUDA, else under the Triton interpreter (see conftest.py). The interpreter's bf16 dot
is not faithful, so CPU runs check float32 (tight) and float16; bf16 is checked on the GPU.
"""

import pytest
import torch

from pagedkv.ops import reference
from pagedkv.ops.triton import attention, split_k
from triton_cases import DEVICE, build_case, rel_err

FORMATS = ["off", "q8", "q6", "q4", "q4:rotate_keys", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant:k=q5_0,v=q2_0",
           "turboquant:k=int2,v=q8_0"]
# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 4 and 8; head_dim 64 and 128
SHAPES = [(2, 2, 64, 16), (8, 2, 128, 16), (8, 1, 64, 5)]
# decode tokens and prefill chunks in one batch; lengths off the block size; one sequence without new tokens
CTX_LENS = [0, 37, 5, 20, 9]
NEW_LENS = [21, 1, 9, 1, 0]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def run_kernel(variant, case, **kw):
    if variant == "varlen":
        return attention.paged_attention(case.query, case.pages, case.fmt, case.meta, **kw)
    return split_k.paged_attention(case.query, case.pages, case.fmt, case.meta, num_splits=3, **kw)


@pytest.mark.parametrize("variant", ["varlen", "split_k"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_reference(fmt, shape, variant):
    hq, hkv, d, bs = shape
    case = build_case(hash((fmt, shape)) % 1000, fmt, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    scale = d ** -0.5
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    out = run_kernel(variant, case, scale=scale)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("variant", ["varlen", "split_k"])
@pytest.mark.parametrize("options", [dict(sliding_window=7), dict(softcap=3.0), dict(sliding_window=16, softcap=2.0)],
                         ids=["window", "softcap", "window_softcap"])
@pytest.mark.parametrize("fmt", ["off", "q4"])
def test_window_and_softcap_match_reference(fmt, options, variant):
    case = build_case(7, fmt, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      ctx_lens=[0, 61, 3], new_lens=[33, 1, 17])
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.3, **options)
    out = run_kernel(variant, case, scale=0.3, **options)
    assert rel_err(out, ref) < TOL[torch.float32]


DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("variant", ["varlen", "split_k"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_half_precision_matches_reference(fmt, dtype, variant):
    case = build_case(3, fmt, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=dtype)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=128 ** -0.5)
    out = run_kernel(variant, case, scale=128 ** -0.5)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_split_k_with_more_splits_than_tiles():
    """Splits past a sequence's end, and table columns past its blocks, contribute nothing."""
    case = build_case(11, "off", num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                      ctx_lens=[3, 40], new_lens=[1, 1], extra_table_cols=4)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    out = split_k.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125, num_splits=8)
    assert rel_err(out, ref) < TOL[torch.float32]
