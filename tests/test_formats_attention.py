"""The reference paged attention over every format equals dense attention over decode(encode(k, v))."""

import pytest
import torch

from pagedkv import KVFormat
from pagedkv.formats import make_format
from pagedkv.ops import reference
from pagedkv.ops.metadata import AttentionMetadata

FORMATS = ["off", "q8", "q6", "q4", "q4:rotate_keys", "q8:rotate_keys", "turboquant", "turboquant:k=q8_0,v=q4_0", "turboquant:k=q5_0,v=q5_0",
           "turboquant:k=q4_0,v=q2_0", "turboquant:k=int2,v=q8_0", "turboquant:k=q4_0,v=q4_0,rotate_keys",
           "turboquant:k=int8,v=q3_0,rotate_keys"]
BLOCK_SIZE = 4


def dense_attention(q, k, v, scale):
    """q [nq, Hq, D] = the last nq positions of a sequence; k, v [L, Hkv, D]; float64, causal."""
    nq, hq, d = q.shape
    length, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(length - nq, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("spec", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_attention_over_pages_equals_dense_attention_over_decoded_kv(spec, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    fmt = make_format(KVFormat.parse(spec), 2, head_dim, torch.float32, "cpu")
    pages = {name: torch.zeros(16, BLOCK_SIZE, 2, width, dtype=dt) for name, (width, dt) in fmt.page_spec().items()}
    seq_lens, q_lens = [13, 6, 9], [13, 1, 3]  # a prefill, a decode, a verify step
    tables = [[5, 2, 9, 0], [7, 3, 0, 0], [1, 14, 11, 0]]
    keys = [torch.randn(n, 2, head_dim, generator=gen) * 2 for n in seq_lens]
    values = [torch.randn(n, 2, head_dim, generator=gen) for n in seq_lens]
    for table, k, v in zip(tables, keys, values):
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(k.shape[0])])
        parts = fmt.encode(k, v)
        for name, part in parts.items():
            pages[name].view(-1, *pages[name].shape[2:])[slots] = part.to(pages[name].dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(block_table=torch.tensor(tables, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             slot_mapping=torch.zeros(0, dtype=torch.int64), token_index=None,
                             seq_lens_cpu=seq_lens, query_start_loc_cpu=qsl, block_size=BLOCK_SIZE)
    query = torch.randn(qsl[-1], 6, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = reference.paged_attention(query, pages, fmt, meta, scale=scale)
    for i, (k, v) in enumerate(zip(keys, values)):
        k_hat, v_hat = fmt.decode(fmt.encode(k, v))
        expected = dense_attention(query[qsl[i]:qsl[i + 1]], k_hat, v_hat, scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", FORMATS)
def test_an_empty_write_encodes_and_decodes_to_nothing(spec):
    fmt = make_format(KVFormat.parse(spec), 2, 64, torch.float32, "cpu")
    parts = fmt.encode(torch.zeros(0, 2, 64), torch.zeros(0, 2, 64))
    assert {name: tuple(p.shape) for name, p in parts.items()} == {
        name: (0, 2, width) for name, (width, _) in fmt.page_spec().items()}
    k, v = fmt.decode(parts)
    assert k.shape == v.shape == (0, 2, 64)
