"""Prefill over quantized pages through dense scratch pages (`ops/triton/dense_prefill.py`) against the reference
path: the context dequantized once per block and KV head, then the dense varlen kernel."""

import pytest
import torch

from pagedkv.ops import reference
from pagedkv.ops import triton as triton_ops
from pagedkv.ops.triton import dense_prefill, tuning
from triton_cases import build_case, rel_err

SPECS = ["q8", "q6", "q4", "q4:rotate_keys", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys",
         "turboquant:k=q8_0,v=q4_0"]
# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 4 and 1, head_dim 64 and 128, a block size of 5
SHAPES = [(8, 2, 64, 16), (4, 4, 128, 5)]
# a chunk after context, a first chunk, a short one: 70 / 64 / 6 new tokens
CTX_LENS, NEW_LENS = [37, 0, 20], [70, 64, 6]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("spec", SPECS)
def test_dense_prefill_matches_reference(spec, shape):
    hq, hkv, d, bs = shape
    case = build_case(hash((spec, shape)) % 1000, spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5)
    out = dense_prefill.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5)
    assert rel_err(out, ref) < 1e-5


def test_dense_prefill_options_and_half_precision():
    """Sliding window and softcap pass through to the dense kernel; float16 queries rebuild the pages in float16."""
    case = build_case(3, "turboquant", num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=torch.float16)
    options = dict(scale=0.125, sliding_window=19, softcap=4.0)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, **options)
    out = dense_prefill.paged_attention(case.query, case.pages, case.fmt, case.meta, **options)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 2e-3


def test_dequantize_writes_each_block_of_each_sequence_once():
    """The scratch holds every context block of every sequence in plan order, equal to the format's decode."""
    case = build_case(4, "q4", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=CTX_LENS,
                      new_lens=NEW_LENS)
    plan = dense_prefill.Plan(case.meta)
    assert plan.num_blocks == sum(-(-n // 16) for n in case.meta.seq_lens_cpu) == plan.rows.shape[0]
    k, v = dense_prefill.dequantize(case.pages, case.fmt, case.meta, torch.float32, plan)
    for r, (seq, j) in enumerate(plan.rows.tolist()):
        block = int(case.meta.block_table[seq, j])
        keys, values = case.fmt.decode({name: t[block] for name, t in case.pages.items()})
        used = min(16, case.meta.seq_lens_cpu[seq] - 16 * j)   # slots past a sequence's end were never written
        assert torch.allclose(k[r, :used], keys[:used], atol=1e-6) and torch.allclose(v[r, :used], values[:used], atol=1e-6)
    assert plan.table[0, :7].tolist() == list(range(7)) and plan.table[1, 0] == 7   # 107 tokens: 7 blocks, then 64


def test_when_the_path_applies(monkeypatch):
    case = build_case(5, "q8", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=[100, 10],
                      new_lens=[64, 64])
    assert dense_prefill.applies(128, case.fmt, case.meta)
    assert not dense_prefill.applies(2, case.fmt, case.meta)                 # decode-like: the fused kernels
    monkeypatch.setattr(dense_prefill, "MAX_TOKENS", 100)
    assert not dense_prefill.applies(128, case.fmt, case.meta)               # scratch over its budget
    dense = build_case(5, "off", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=[100, 10],
                       new_lens=[64, 64])
    assert not dense_prefill.applies(128, dense.fmt, dense.meta)             # dense pages need no conversion


def test_dispatch_takes_the_path_when_enabled(monkeypatch):
    case = build_case(6, "q6", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=[30, 5],
                      new_lens=[64, 70])
    calls = []
    real = dense_prefill.paged_attention
    monkeypatch.setattr(dense_prefill, "paged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(tuning, "DENSE_PREFILL", True)
    out = triton_ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    assert calls == [1]
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    assert rel_err(out, ref) < 1e-5
