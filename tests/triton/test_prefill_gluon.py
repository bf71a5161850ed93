"""The Gluon prefill kernel over dense pages (`ops/triton/prefill_gluon.py`) against the reference path, on a Hopper
GPU. Gluon has no interpreter: on the CPU, `test_sm90_compile.py` compiles it for sm_90."""

import pytest
import torch

from pagedkv.ops import reference
from pagedkv.ops import triton as triton_ops
from triton_cases import build_case, rel_err

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs a Hopper GPU")

# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 4, 3 (the default model's), 1, 8 and 16; blocks of 16-128
SHAPES = [(32, 8, 128, 16), (9, 3, 64, 16), (4, 4, 128, 32), (8, 1, 64, 64), (16, 1, 128, 16), (8, 2, 64, 128)]
# a first chunk past two key tiles, chunks after context (on and off the tile and block sizes), one token, none
CTX_LENS = [0, 37, 300, 128, 5, 9]
NEW_LENS = [300, 70, 129, 256, 1, 0]
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}kv{}d{}bs{}".format(*s))
def test_gluon_prefill_matches_reference(shape, dtype):
    """A hang here is a barrier count or phase (`ws_producer`, `ws_consumer`)."""
    from pagedkv.ops.triton import prefill_gluon

    hq, hkv, d, bs = shape
    case = build_case(hash(shape) % 1000, "off", num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=dtype)
    assert prefill_gluon.supports(case.query, case.pages, case.fmt, case.meta)
    scale = d ** -0.5
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
    out = prefill_gluon.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    # and the dispatch takes it for a prefill batch over dense pages
    served = triton_ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    assert torch.equal(served, out)


@pytest.mark.gpu
@hopper
def test_gluon_prefill_long_chunk_with_nan_past_the_end():
    """A 2,048-token chunk after 1,000 tokens of context, then slots past the sequences' ends set to NaN: the output
    is the reference's over the clean pages (the last value tile's tail is zeroed, its keys masked)."""
    from pagedkv.ops.triton import prefill_gluon

    case = build_case(7, "off", num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, ctx_lens=[1000, 0],
                      new_lens=[2048, 1500], dtype=torch.bfloat16, extra_table_cols=2)
    scale = 128 ** -0.5
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
    written = torch.zeros(case.pages["k"].shape[0] * 16, dtype=torch.bool, device=case.query.device)
    written[case.write_meta.slot_mapping] = True
    unwritten = (~written).nonzero().squeeze(1)
    for page in case.pages.values():
        page[unwritten // 16, unwritten % 16] = float("nan")
    out = prefill_gluon.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("spec", ["q8", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys"])
def test_quantized_prefill_through_scratch_pages_runs_the_gluon_kernel(spec, monkeypatch):
    """Prefill over quantized pages (`dense_prefill.py`): the context dequantized into dense scratch pages, then this
    kernel, with TurboQuant's query and output rotations around it; against the reference."""
    from pagedkv.ops.triton import dense_prefill, prefill_gluon

    case = build_case(11, spec, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, ctx_lens=[300, 0],
                      new_lens=[257, 130], dtype=torch.bfloat16)
    calls = []
    launch = prefill_gluon.paged_attention
    monkeypatch.setattr(prefill_gluon, "paged_attention", lambda *a, **k: calls.append(1) or launch(*a, **k))
    scale = 128 ** -0.5
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
    out = dense_prefill.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    assert calls == [1]
    assert rel_err(out, ref) < TOL[torch.bfloat16]



def test_the_copy_rows_address_each_blocks_slots_of_one_head():
    """What the kernel's TMA copies rely on (CPU): a page tensor as stored is rows [num_blocks * num_kv_heads *
    block_size, head_dim], block b's slots of KV head h starting at row (b * num_kv_heads + h) * block_size; dense
    scratch pages are stored so too; pages stored slot-major are refused (the tile-language kernel reads them)."""
    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops.triton import dense_prefill, prefill_gluon

    device = "cuda" if torch.cuda.is_available() else "cpu"  # dequantize is a Triton kernel: the GPU's, or interpreted
    fmt = make_format(KVFormat.parse("off"), 3, 64, torch.bfloat16, device)
    pages = fmt.allocate_pages(5, 16)
    pages["k"].copy_(torch.randn(pages["k"].shape))
    rows = prefill_gluon._stored(pages["k"])
    assert rows.shape == (5 * 3 * 16, 64) and rows.data_ptr() == pages["k"].data_ptr()
    for b, h, slot in [(0, 0, 0), (4, 2, 15), (2, 1, 7)]:
        assert torch.equal(rows[(b * 3 + h) * 16 + slot], pages["k"][b, slot, h])
    k_scratch, _ = dense_prefill.dequantize(pages, fmt, build_case(1, "off", num_q_heads=6, num_kv_heads=3, head_dim=64,
                                                                   block_size=16, ctx_lens=[40], new_lens=[30]).meta,
                                            torch.bfloat16)
    assert prefill_gluon._stored(k_scratch) is not None
    assert prefill_gluon._stored(torch.empty(5, 16, 3, 64, dtype=torch.bfloat16, device=device)) is None
