"""Prefix caching: content hashes, sharing full blocks by reference count, LRU eviction, every page format."""

import pytest
import torch

from pagedkv import LLM, PagedKVCache, SamplingParams
from pagedkv.prefix import PrefixCache, extend_block_hashes, hash_block


def test_block_hash_is_a_pure_function_of_parent_tokens_and_format():
    a = hash_block(None, [1, 2, 3, 4], "off")
    assert a == hash_block(None, [1, 2, 3, 4], "off")
    assert a != hash_block(None, [1, 2, 3, 5], "off")
    assert a != hash_block(None, [1, 2, 3, 4], "q8")
    assert hash_block(a, [5, 6, 7, 8], "off") != hash_block(None, [5, 6, 7, 8], "off")


def test_block_hashes_cover_full_blocks_only_and_chain():
    hashes = extend_block_hashes([], list(range(10)), 4, "off")
    assert len(hashes) == 2  # tokens 8, 9 make no full block
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7], "off")
    assert extend_block_hashes(list(hashes), list(range(12)), 4, "off")[:2] == hashes
    assert len(extend_block_hashes([], list(range(12)), 4, "off", num_tokens=7)) == 1


def _filled_cache(num_blocks=8, block_size=4):
    cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size)
    return cache, PrefixCache(cache)


def _write(cache, seq_id, num_tokens):
    """Reserve and write random keys/values for the next num_tokens of a sequence."""
    cache.begin_step([seq_id], [num_tokens])
    k = torch.randn(num_tokens, 2, 8)
    cache.write(0, k, k.clone())
    cache.end_forward()


def test_new_sequence_starts_from_cached_blocks_by_reference():
    cache, prefix = _filled_cache()
    tokens = list(range(10))
    hashes = prefix.block_hashes([], tokens)
    a = cache.add_sequence()
    _write(cache, a, 10)
    assert prefix.register(a, hashes, 0, 10) == 2
    blocks = cache.block_table(a)
    matched = prefix.match(hashes, max_blocks=2)
    assert matched == blocks[:2]
    b = cache.add_sequence(prefix_block_ids=matched)
    assert cache.seq_len(b) == 8 and cache.block_table(b) == blocks[:2]
    assert [cache.pool.ref_cnt[x] for x in blocks] == [2, 2, 1]
    keys_a, _ = cache.read(a, 0)
    keys_b, _ = cache.read(b, 0)
    assert torch.equal(keys_a[:8], keys_b)
    prefix.release(a)
    prefix.release(b)
    assert cache.pool.num_used == 0 and cache.pool.num_cached() == 2
    cache.pool.check()


def test_release_frees_tail_first_so_prefix_roots_are_evicted_last():
    cache, prefix = _filled_cache(num_blocks=4)
    tokens = list(range(12))
    hashes = prefix.block_hashes([], tokens)
    a = cache.add_sequence()
    _write(cache, a, 12)
    prefix.register(a, hashes, 0, 12)
    blocks = cache.block_table(a)
    prefix.release(a)
    assert list(cache.pool._free) == [3] + blocks[::-1]  # the never-used block, then the tail first
    # allocating two blocks evicts the never-used one and the last block of the prefix
    b = cache.add_sequence()
    _write(cache, b, 8)
    assert cache.pool.num_evictions == 1
    assert prefix.match(hashes, 3) == blocks[:2]  # the first two blocks are still cached


def test_unmatch_returns_references_and_keeps_blocks_cached():
    cache, prefix = _filled_cache()
    hashes = prefix.block_hashes([], list(range(8)))
    a = cache.add_sequence()
    _write(cache, a, 8)
    prefix.register(a, hashes, 0, 8)
    prefix.release(a)
    matched = prefix.match(hashes, 2)
    assert cache.pool.num_used == 2
    prefix.unmatch(matched)
    assert cache.pool.num_used == 0 and cache.pool.num_cached() == 2


def test_disabled_prefix_cache_matches_nothing():
    cache = PagedKVCache(num_blocks=8, block_size=4)
    prefix = PrefixCache(cache, enabled=False)
    a = cache.add_sequence()
    _write(cache, a, 8)
    hashes = extend_block_hashes([], list(range(8)), 4, "off")
    assert prefix.register(a, hashes, 0, 8) == 0
    assert prefix.match(hashes, 2) == [] and cache.pool.num_cached() == 0


@pytest.mark.parametrize("kv_format", ["off", "q8", "q4", "turboquant"])
def test_prefix_caching_works_with_every_page_format(model_and_tokenizer, kv_format):
    model, tokenizer = model_and_tokenizer
    shared = tokenizer("It is a truth universally acknowledged, that a single man in possession of a good "
                       "fortune, must be in want of a wife.").input_ids[:16]
    prompts = [shared + tokenizer(" Who said this?").input_ids, shared + tokenizer(" Is it true?").input_ids]
    params = SamplingParams(max_tokens=2)
    uncached = LLM(model, tokenizer=tokenizer, kv_format=kv_format, num_blocks=16, prefix_caching=False)
    expected = uncached.generate(prompts[1], params)[0].token_ids
    llm = LLM(model, tokenizer=tokenizer, kv_format=kv_format, num_blocks=16, block_size=8)
    llm.generate(prompts[0], params)
    out = llm.generate(prompts[1], params)[0]
    assert out.metrics.num_cached_tokens == 16
    assert llm.stats()["prefix_cache_hit_tokens"] == 16
    assert out.token_ids == expected
    assert llm.stats()["blocks_used"] == 0
