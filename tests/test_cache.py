"""PagedKVCache: sequences, block tables, capacity, growth, trim/fork/free, stats."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import CacheCapacityError, ConfigError, PagedKVCache
from pagedkv.errors import CacheMismatchError

H, D = 2, 8


def append(cache, seq_id, keys, values, layers=2):
    """Write keys/values [n, H, D] for one sequence into every layer."""
    meta = cache.begin_step([seq_id], [keys.shape[0]])
    for layer in range(layers):
        cache.write(layer, keys + layer, values - layer, meta)
    cache.end_forward()


def test_pages_are_lazy_and_shaped_per_layer():
    cache = PagedKVCache(block_size=4, num_blocks=8)
    assert cache.key_cache is None and cache.value_cache is None
    s = cache.add_sequence()
    append(cache, s, torch.randn(5, H, D), torch.randn(5, H, D))
    assert len(cache.key_cache) == 2
    assert cache.key_cache[0].shape == (8, 4, H, D)
    assert cache.block_table(s) == [0, 1]
    stats = cache.paged_stats()
    assert stats["used_blocks"] == 2 and stats["tokens"] == 5 and stats["allocated_blocks"] == 8
    assert stats["capacity_tokens"] == 32


def test_defaults_follow_the_design():
    cache = PagedKVCache()
    assert cache.block_size == 16 and cache.num_blocks == 1024


def test_read_back_what_was_written_through_shuffled_blocks():
    cache = PagedKVCache(block_size=4, num_blocks=16)
    a, b = cache.add_sequence(), cache.add_sequence()
    ka, va = torch.randn(6, H, D), torch.randn(6, H, D)
    kb, vb = torch.randn(9, H, D), torch.randn(9, H, D)
    append(cache, a, ka[:3], va[:3])
    append(cache, b, kb[:5], vb[:5])
    append(cache, a, ka[3:], va[3:])  # a's blocks are now interleaved with b's
    append(cache, b, kb[5:], vb[5:])
    assert cache.block_table(a) != list(range(len(cache.block_table(a))))
    k, v = cache.read(a, 1)
    torch.testing.assert_close(k, ka + 1)
    torch.testing.assert_close(v, va - 1)
    k, v = cache.read(b, 0)
    torch.testing.assert_close(k, kb)


def test_write_past_capacity_raises_and_leaves_cache_unchanged():
    cache = PagedKVCache(block_size=4, num_blocks=3)
    s = cache.add_sequence()
    append(cache, s, torch.randn(10, H, D), torch.randn(10, H, D))
    before_stats = cache.paged_stats()
    before_pages = [{n: t.clone() for n, t in p.items()} for p in cache.pages]
    with pytest.raises(CacheCapacityError, match=r"needs 1 more blocks but only 0 are available"):
        cache.begin_step([s], [3])
    assert cache.paged_stats() == before_stats
    assert cache.seq_len(s) == 10 and cache.block_table(s) == [0, 1, 2]
    for p, q in zip(cache.pages, before_pages):
        for name in p:  # bit for bit: never-written slots hold whatever memory held, NaN patterns included
            assert torch.equal(p[name].view(torch.uint8), q[name].view(torch.uint8))


def test_capacity_error_is_all_or_nothing_across_sequences():
    cache = PagedKVCache(block_size=4, num_blocks=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    append(cache, a, torch.randn(4, H, D), torch.randn(4, H, D))
    with pytest.raises(CacheCapacityError):
        cache.begin_step([a, b], [4, 9])  # a would fit, b would not: neither is written
    assert cache.seq_len(a) == 4 and cache.seq_len(b) == 0
    assert cache.paged_stats()["used_blocks"] == 1


def test_dynamic_growth_is_geometric():
    cache = PagedKVCache(block_size=4, num_blocks=2, dynamic=True)
    s = cache.add_sequence()
    append(cache, s, torch.randn(4, H, D), torch.randn(4, H, D))
    assert cache.paged_stats()["allocated_blocks"] == 1  # sized by the first write
    ks = torch.randn(40, H, D)
    for i in range(4, 40, 4):
        append(cache, s, ks[i:i + 4], ks[i:i + 4])
    stats = cache.paged_stats()
    assert stats["used_blocks"] == 10
    assert stats["grow_events"] >= 3
    assert stats["allocated_blocks"] < 10 * 1.5 + 1
    k, _ = cache.read(s, 0)
    torch.testing.assert_close(k[4:], ks[4:])


@pytest.mark.parametrize("kv_format", ["off", "q4", "turboquant"])
def test_pages_stay_head_major_through_growth(kv_format):
    """Each KV head's slots of a block lie side by side in memory (what the decode kernels read fastest), from the
    first allocation and after the pool grows, and what was written reads back across the growth."""
    from pagedkv.formats.base import stored_blocks

    cache = PagedKVCache(block_size=4, num_blocks=2, dynamic=True, kv_format=kv_format)
    s = cache.add_sequence()
    ks, vs = torch.randn(24, H, 64), torch.randn(24, H, 64)
    for i in range(0, 24, 4):
        append(cache, s, ks[i:i + 4], vs[i:i + 4], layers=1)
        for name, page in cache.pages[0].items():
            assert stored_blocks(page).is_contiguous(), (name, page.stride())
            assert page.stride(1) == page.shape[3] and page.stride(2) == page.shape[1] * page.shape[3]
    assert cache.paged_stats()["grow_events"] >= 2
    want_k, want_v = cache.formats[0].decode(cache.formats[0].encode(ks, vs))
    k, v = cache.read(s, 0)
    torch.testing.assert_close(k, want_k.to(k.dtype))
    torch.testing.assert_close(v, want_v.to(v.dtype))


def test_growth_stops_at_the_context_window_cap():
    cache = PagedKVCache(block_size=4, num_blocks=1, dynamic=True, context_window_tokens=16)
    s = cache.add_sequence()
    append(cache, s, torch.randn(16, H, D), torch.randn(16, H, D))
    assert cache.paged_stats()["allocated_blocks"] == 4
    with pytest.raises(CacheCapacityError, match="context_window_tokens=16"):
        append(cache, s, torch.randn(1, H, D), torch.randn(1, H, D))
    assert cache.seq_len(s) == 16 and cache.paged_stats()["allocated_blocks"] == 4


@pytest.mark.parametrize("dyn_var,ctx_var", [("PAGEDKV_DYNAMIC", "PAGEDKV_CONTEXT_WINDOW_TOKENS"),
                                             ("MTPLX_DYNAMIC_PAGED_KV", "MTPLX_CONTEXT_WINDOW_TOKENS")])
def test_environment_turns_on_growth_and_caps_it(monkeypatch, dyn_var, ctx_var):
    for name in ("PAGEDKV_DYNAMIC", "PAGEDKV_CONTEXT_WINDOW_TOKENS", "MTPLX_DYNAMIC_PAGED_KV", "MTPLX_CONTEXT_WINDOW_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(dyn_var, "1")
    monkeypatch.setenv(ctx_var, "8")
    cache = PagedKVCache(block_size=4, num_blocks=1)
    assert cache.config.dynamic and cache.config.context_window_tokens == 8
    a, b = cache.add_sequence(), cache.add_sequence()
    append(cache, a, torch.randn(8, H, D), torch.randn(8, H, D))
    append(cache, b, torch.randn(8, H, D), torch.randn(8, H, D))  # two live sequences: cap is 2 x 2 blocks
    assert cache.paged_stats()["allocated_blocks"] == 4
    with pytest.raises(CacheCapacityError):
        append(cache, a, torch.randn(1, H, D), torch.randn(1, H, D))
    # arguments win over the environment
    assert PagedKVCache(dynamic=False).config.dynamic is False
    assert PagedKVCache(context_window_tokens=99).config.context_window_tokens == 99


def test_bad_environment_values_are_named(monkeypatch):
    monkeypatch.setenv("PAGEDKV_DYNAMIC", "maybe")
    with pytest.raises(ConfigError, match="PAGEDKV_DYNAMIC"):
        PagedKVCache()


def test_trim_returns_blocks_to_pool():
    cache = PagedKVCache(block_size=4, num_blocks=8)
    s = cache.add_sequence()
    append(cache, s, torch.randn(10, H, D), torch.randn(10, H, D))
    assert cache.trim(3, seq_id=s) == 3
    assert cache.seq_len(s) == 7 and len(cache.block_table(s)) == 2
    assert cache.paged_stats()["used_blocks"] == 2
    assert cache.trim(100, seq_id=s) == 7
    assert cache.paged_stats()["used_blocks"] == 0


def test_crop_keeps_a_prefix():
    cache = PagedKVCache(block_size=4, num_blocks=8)
    s = cache.add_sequence()
    append(cache, s, torch.randn(10, H, D), torch.randn(10, H, D))
    assert cache.crop(6, seq_id=s) == 4 and cache.seq_len(s) == 6
    assert cache.crop(-2, seq_id=s) == 2 and cache.seq_len(s) == 4


def test_fork_shares_full_blocks_and_copies_partial_on_write():
    cache = PagedKVCache(block_size=4, num_blocks=8)
    a = cache.add_sequence()
    ka = torch.randn(6, H, D)
    append(cache, a, ka, ka)
    b = cache.fork(a)
    assert cache.block_table(b) == cache.block_table(a)
    assert cache.paged_stats()["used_blocks"] == 2
    kb = torch.randn(1, H, D)
    append(cache, b, kb, kb)
    ta, tb = cache.block_table(a), cache.block_table(b)
    assert ta[0] == tb[0] and ta[1] != tb[1]  # full block shared, partial block copied
    torch.testing.assert_close(cache.read(a, 0)[0], ka)
    torch.testing.assert_close(cache.read(b, 0)[0], torch.cat([ka, kb]))
    cache.free(a)
    torch.testing.assert_close(cache.read(b, 1)[0], torch.cat([ka, kb]) + 1)
    cache.free(b)
    assert cache.paged_stats()["used_blocks"] == 0
    cache.pool.check()


def test_mismatched_head_dim_is_refused():
    cache = PagedKVCache(block_size=4, num_blocks=8)
    s = cache.add_sequence()
    append(cache, s, torch.randn(2, H, D), torch.randn(2, H, D))
    cache.begin_step([s], [1])
    with pytest.raises(CacheMismatchError, match="head_dim"):
        cache.write(0, torch.randn(1, H, D * 2), torch.randn(1, H, D * 2))


def test_bad_options_name_the_setting():
    with pytest.raises(ConfigError, match="block_size"):
        PagedKVCache(block_size=0)
    with pytest.raises(ConfigError, match="accepted forms"):
        PagedKVCache(kv_format="q7")


def test_reset_frees_everything():
    cache = PagedKVCache(block_size=4, num_blocks=8)
    s = cache.add_sequence()
    append(cache, s, torch.randn(9, H, D), torch.randn(9, H, D))
    cache.reset()
    stats = cache.paged_stats()
    assert stats["used_blocks"] == 0 and stats["tokens"] == 0 and stats["sequences"] == 0
    assert cache.key_cache is not None  # pages stay allocated for reuse


class Model:
    """What each sequence should read back."""

    def __init__(self):
        self.data = {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["append", "trim", "fork", "free", "new"]),
                          st.integers(0, 7), st.integers(1, 11)), min_size=1, max_size=40),
       st.sampled_from([1, 3, 4]), st.booleans())
def test_random_operations_never_leak_or_double_free(ops_list, block_size, dynamic):
    cache = PagedKVCache(block_size=block_size, num_blocks=24, dynamic=dynamic)
    expected: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(len(ops_list))
    for op, pick, n in ops_list:
        live = sorted(expected)
        if op == "new" or not live:
            s = cache.add_sequence()
            expected[s] = torch.empty(0, H, D)
            continue
        s = live[pick % len(live)]
        if op == "append":
            k = torch.randn(n, H, D, generator=gen)
            try:
                append(cache, s, k, -k, layers=1)
            except CacheCapacityError:
                assert not dynamic
                continue
            expected[s] = torch.cat([expected[s], k])
        elif op == "trim":
            removed = cache.trim(n, seq_id=s)
            assert removed == min(n, expected[s].shape[0])
            expected[s] = expected[s][: expected[s].shape[0] - removed]
        elif op == "fork":
            child = cache.fork(s)
            expected[child] = expected[s].clone()
        elif op == "free":
            cache.free(s)
            del expected[s]
        cache.pool.check()
        refs = {}
        for seq in cache.seqs.values():
            assert len(seq.block_ids) == -(-seq.num_tokens // block_size)
            for b in seq.block_ids:
                refs[b] = refs.get(b, 0) + 1
        for b in range(cache.pool.num_blocks):
            assert cache.pool.ref_cnt[b] == refs.get(b, 0), "reference counts must equal table references"
    for s, k in expected.items():
        assert cache.seq_len(s) == k.shape[0]
        if k.shape[0] and cache.pages:
            got_k, got_v = cache.read(s, 0)
            torch.testing.assert_close(got_k, k)
            torch.testing.assert_close(got_v, -k)
    for s in list(expected):
        cache.free(s)
    assert cache.pool.num_used == 0
    cache.pool.check()
