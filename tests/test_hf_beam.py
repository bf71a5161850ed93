"""Beam search in transformers over a PagedKVCache: reordering beams moves block-table rows and reference counts,
never pages, and gives the tokens a DynamicCache gives (over the same page format's encode/decode)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pagedkv import PagedKVCache, install_paged_kv_cache
from pagedkv.formats import make_format
from pagedkv.hf import cache_kwarg

FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q3_0,rotate_keys"]
BLOCK_SIZE = 4


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(config).to(torch.float64).eval()


class FormatDynamicCache(DynamicCache):
    """A DynamicCache holding what the paged attention reads: decode(encode(k, v)) of every new token (KV-Quant:
    through its dense mirror's dtype, bfloat16 by default)."""

    def __init__(self, kv_format: str, config):
        super().__init__(config=config)
        self.spec = PagedKVCache(kv_format=kv_format).config.kv_format

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        batch, heads, num_cols, head_dim = key_states.shape  # [B, H, T, D]
        fmt = make_format(self.spec, heads, head_dim, key_states.dtype, key_states.device)
        flat = [x.transpose(1, 2).reshape(batch * num_cols, heads, head_dim) for x in (key_states, value_states)]
        mirror = getattr(fmt, "mirror_dtype", key_states.dtype)
        k, v = (x.to(mirror).to(key_states.dtype).reshape(batch, num_cols, heads, head_dim).transpose(1, 2)
                for x in fmt.decode(fmt.encode(*flat)))
        return super().update(k.contiguous(), v.contiguous(), layer_idx, *args, **kwargs)


def beam_search(model, cache, num_beams: int):
    # a padded batch of two prompts (left padding: the second is shorter)
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 41, 7, 3, 19], [0, 0, 0, 0, 21, 22, 23, 24, 25, 26, 27]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, num_beams=num_beams, num_return_sequences=num_beams,
                              max_new_tokens=10, do_sample=False, early_stopping=False, length_penalty=1.0,
                              **{cache_kwarg(model): cache})


@pytest.mark.parametrize("kv_format", FORMATS)
def test_beam_search_equals_dynamic_cache_and_beams_share_blocks(kv_format):
    model = tiny_llama()
    for num_beams in (3, 4):
        reference = FormatDynamicCache(kv_format, model.config) if kv_format != "off" else DynamicCache(config=model.config)
        expected = beam_search(model, reference, num_beams)
        paged = install_paged_kv_cache(model, kv_format=kv_format, block_size=BLOCK_SIZE, num_blocks=256)
        got = beam_search(model, paged, num_beams)
        assert torch.equal(got, expected), (kv_format, num_beams, got, expected)
        # the widest point is the end: every beam holds its longest sequence, yet their prompts share blocks
        stats = paged.paged_stats()
        rows = paged.batch_seq_ids
        assert stats["sequences"] == len(rows) == 2 * num_beams
        blocks_per_beam = max(len(paged.block_table(s)) for s in rows)
        assert stats["used_blocks"] < len(rows) * blocks_per_beam, stats
        shared = [b for b in paged.block_table(rows[0]) if paged.pool.ref_cnt[b] > 1]
        assert shared, "the first beam shares no block with another"


def test_reordering_moves_rows_and_reference_counts_not_pages():
    cache = PagedKVCache(block_size=BLOCK_SIZE, num_blocks=32)
    cache.set_batch([cache.add_sequence() for _ in range(2)])
    cache.begin_step(cache.batch_seq_ids, [6, 6])
    k = torch.randn(12, 1, 8)
    cache.write(0, k, k)
    cache.end_forward()
    pages = cache.pages[0]["k"].clone()
    first, second = (cache.block_table(s) for s in cache.batch_seq_ids)
    cache.reorder_cache(torch.tensor([1, 1, 1]))  # three beams continue row 1; row 0 is dropped
    assert [cache.block_table(s) for s in cache.batch_seq_ids] == [second] * 3
    assert [cache.pool.ref_cnt[b] for b in second] == [3, 3] and cache.pool.num_used == 2
    # nothing copied, nothing moved: the same bytes (the blocks' unwritten slots hold whatever the pool's memory
    # held, NaN included, so values would not compare equal to themselves)
    assert torch.equal(cache.pages[0]["k"][second].view(torch.uint8), pages[second].view(torch.uint8))
    cache.begin_step(cache.batch_seq_ids, [1, 1, 1])  # each beam writes into the shared partial block
    cache.write(0, k[:3], k[:3])
    cache.end_forward()
    tables = [cache.block_table(s) for s in cache.batch_seq_ids]
    assert all(t[0] == second[0] for t in tables) and len({t[1] for t in tables}) == 3  # two copies, one in place
    assert cache.pool.num_used == 4 and all(cache.pool.ref_cnt[t[1]] == 1 for t in tables)
    cache.batch_select_indices(torch.tensor([2]))
    assert cache.pool.num_used == 2 and len(cache.seqs) == 1
    cache.batch_repeat_interleave(2)
    assert len(cache.seqs) == 2 and cache.pool.num_used == 2
