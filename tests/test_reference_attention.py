"""Reference paged attention against float64 dense causal attention."""

import math
import random

import pytest
import torch

from pagedkv.config import KVFormat
from pagedkv.formats import make_format
from pagedkv.ops import reference
from pagedkv.ops.metadata import AttentionMetadata


def dense_attention_f64(q, k, v, *, scale, sliding_window=None, softcap=None):
    """q: [nq, Hq, D] for the last nq positions; k, v: [L, Hkv, D]; float64 result [nq, Hq, D]."""
    nq, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(length - nq, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos > q_pos
    if sliding_window:
        mask |= k_pos <= q_pos - sliding_window
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def build_case(rng, *, num_q_heads, num_kv_heads, head_dim, block_size, ctx_lens, new_lens):
    """Pages holding random keys/values for several sequences on shuffled blocks; returns everything to compare."""
    seq_lens = [c + n for c, n in zip(ctx_lens, new_lens)]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for nb in blocks_per_seq:
        tables.append(ids[pos:pos + nb])
        pos += nb
    max_blocks = max(blocks_per_seq)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    fmt = make_format(KVFormat(), num_kv_heads, head_dim, torch.float32, "cpu")
    pages = fmt.allocate_pages(num_blocks, block_size)
    for p in pages.values():
        p.fill_(float("nan"))  # unwritten slots must never be read
    keys = [torch.randn(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim) for s in seq_lens]
    slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size
                          for i, s in enumerate(seq_lens) for p in range(s)], dtype=torch.int64)
    all_qsl = [0]
    for s in seq_lens:
        all_qsl.append(all_qsl[-1] + s)
    write_meta = AttentionMetadata(block_table, torch.tensor(seq_lens, dtype=torch.int32),
                                   torch.tensor(all_qsl, dtype=torch.int32), slots, None, seq_lens, all_qsl, block_size)
    reference.write_kv(pages, fmt, torch.cat(keys), torch.cat(values), write_meta)
    qsl = [0]
    for n in new_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(block_table, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                             torch.empty(0, dtype=torch.int64), None, seq_lens, qsl, block_size)
    queries = [torch.randn(n, num_q_heads, head_dim) for n in new_lens]
    return pages, fmt, meta, queries, keys, values


CASES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 64, 16), (6, 2, 64, 1), (8, 1, 128, 32), (9, 3, 64, 16), (16, 2, 128, 16), (3, 3, 128, 1), (24, 3, 64, 32),
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("variant", ["plain", "sliding_window", "softcap", "both"])
def test_reference_matches_float64_dense(num_q_heads, num_kv_heads, head_dim, block_size, variant):
    rng = random.Random(hash((num_q_heads, num_kv_heads, head_dim, block_size, variant)) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    # one batch mixing prefill (no context), decode (1 new token) and chunked prefill after context
    ctx_lens = [0, rng.randrange(1, 70), rng.randrange(17, 90), 0]
    new_lens = [rng.randrange(1, 40), 1, rng.randrange(2, 30), 1]
    window = rng.randrange(3, 20) if variant in ("sliding_window", "both") else None
    softcap = 7.5 if variant in ("softcap", "both") else None
    pages, fmt, meta, queries, keys, values = build_case(
        rng, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        ctx_lens=ctx_lens, new_lens=new_lens)
    scale = head_dim ** -0.5
    out = reference.paged_attention(torch.cat(queries), pages, fmt, meta, scale=scale, sliding_window=window, softcap=softcap)
    assert out.dtype == torch.float32 and out.shape == (sum(new_lens), num_q_heads, head_dim)
    expected = torch.cat([dense_attention_f64(q, k, v, scale=scale, sliding_window=window, softcap=softcap)
                          for q, k, v in zip(queries, keys, values)])
    err = (out.double() - expected).abs().max().item()
    assert err <= 1e-5, err


def test_lengths_are_not_block_multiples_and_tables_are_shuffled():
    rng = random.Random(7)
    pages, fmt, meta, queries, keys, values = build_case(rng, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                                         ctx_lens=[33, 0], new_lens=[1, 47])
    table = meta.block_table.tolist()
    assert table[0][:3] != sorted(table[0][:3]) or table[1][:3] != sorted(table[1][:3])
    assert all(s % 16 for s in meta.seq_lens_cpu)
    out = reference.paged_attention(torch.cat(queries), pages, fmt, meta, scale=0.125)
    expected = torch.cat([dense_attention_f64(q, k, v, scale=0.125) for q, k, v in zip(queries, keys, values)])
    assert (out.double() - expected).abs().max().item() <= 1e-5


def test_long_prefill_is_processed_in_query_chunks():
    rng = random.Random(3)
    n = reference.QUERY_CHUNK + 37
    pages, fmt, meta, queries, keys, values = build_case(rng, num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                                                         ctx_lens=[5], new_lens=[n])
    out = reference.paged_attention(queries[0], pages, fmt, meta, scale=0.125)
    expected = dense_attention_f64(queries[0], keys[0], values[0], scale=0.125)
    assert (out.double() - expected).abs().max().item() <= 1e-5
