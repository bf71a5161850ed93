"""KV-Quant's dense mirror and the attention route latched per request."""

import pytest
import torch

import pagedkv.ops as ops
from pagedkv import KVFormat, PagedKVCache
from pagedkv.ops import reference

HEADS, HEAD_DIM, Q_HEADS = 2, 64, 4
SCALE = HEAD_DIM ** -0.5


def make_cache(mirror_dtype=torch.float32, num_layers=2):
    spec = KVFormat(kind="kvquant", mode="q8", dtype=mirror_dtype)
    return PagedKVCache(kv_format=spec, block_size=4, num_blocks=32, num_layers=num_layers, kernels="auto")


def step(cache, seq_ids, counts, gen, num_layers=2):
    """One planned forward: write random keys/values to every layer and attend. Returns per-layer outputs."""
    cache.begin_step(seq_ids, counts)
    n = sum(counts)
    outs = []
    for layer in range(num_layers):
        k = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
        cache.write(layer, k, v)
        outs.append(cache.attention(layer, torch.randn(n, Q_HEADS, HEAD_DIM, generator=gen), scale=SCALE))
    return outs


def direct_attention(cache, layer, seq_id, query, mirror_dtype):
    """Attention over the decoded pages of one sequence (what the mirror must reproduce)."""
    k, v = cache.read(seq_id, layer)
    return reference.attend(query, k.to(mirror_dtype), v.to(mirror_dtype), scale=SCALE, sliding_window=None,
                            softcap=None)


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_a_decode_step_on_the_mirror_route_dequantizes_only_the_new_tokens():
    gen = torch.Generator().manual_seed(0)
    cache = make_cache()
    a, b = cache.add_sequence(), cache.add_sequence()
    step(cache, [a, b], [10, 7], gen)
    stats = cache.paged_stats()
    assert stats["kv_quant_route"] == "mirror"
    assert stats["kv_quant_dequant_tokens"] == 2 * (10 + 7)  # two layers
    assert stats["kv_quant_mirror_hits"] == 0
    step(cache, [a, b], [1, 1], gen)
    stats = cache.paged_stats()
    assert stats["kv_quant_dequant_tokens"] == 2 * (10 + 7) + 2 * 2
    assert stats["kv_quant_mirror_hits"] == 2 * (10 + 7)
    assert stats["kv_quant_attention_calls"] == 4


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
@pytest.mark.parametrize("mirror_dtype", [torch.float32, torch.bfloat16])
def test_the_mirror_route_attends_over_the_pages_decoded_in_the_mirror_dtype(mirror_dtype):
    gen = torch.Generator().manual_seed(1)
    cache = make_cache(mirror_dtype, num_layers=1)
    s = cache.add_sequence()
    step(cache, [s], [9], gen, num_layers=1)
    cache.begin_step([s], [1])
    cache.write(0, torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, HEADS, HEAD_DIM))
    q = torch.randn(1, Q_HEADS, HEAD_DIM)
    out = cache.attention(0, q, scale=SCALE)
    torch.testing.assert_close(out, direct_attention(cache, 0, s, q, mirror_dtype), atol=1e-6, rtol=0)
    assert cache.mirror.buffers[(s, 0)].keys.dtype == mirror_dtype


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_trim_inside_a_request_keeps_its_latched_route_and_redecodes_rewritten_positions(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    cache = make_cache(num_layers=1)
    s = cache.add_sequence()
    step(cache, [s], [12], gen, num_layers=1)
    assert cache.mirror.routes[s] == "mirror"

    # from now on the fast path would be chosen: a new request would latch "direct"
    kernel_calls = []

    def fake_kernel(query, pages, fmt, meta, **kw):
        kernel_calls.append(meta.seq_ids)
        return reference.paged_attention(query, pages, fmt, meta, **kw)

    monkeypatch.setattr(ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
    monkeypatch.setattr("pagedkv.ops.triton.paged_attention", fake_kernel)
    monkeypatch.setattr("pagedkv.ops.triton.write_kv", reference.write_kv)

    assert cache.trim(3, s) == 3  # a speculative rollback
    before = cache.paged_stats()["kv_quant_dequant_tokens"]
    cache.begin_step([s], [2])  # the verify step rewrites positions 9 and 10
    cache.write(0, torch.randn(2, HEADS, HEAD_DIM, generator=gen), torch.randn(2, HEADS, HEAD_DIM, generator=gen))
    q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=gen)
    out = cache.attention(0, q, scale=SCALE)
    assert kernel_calls == []  # still the mirror route
    assert cache.paged_stats()["kv_quant_route"] == "mirror"
    assert cache.paged_stats()["kv_quant_dequant_tokens"] == before + 2
    expected = direct_attention(cache, 0, s, torch.cat([torch.zeros(9, Q_HEADS, HEAD_DIM), q]), torch.float32)[9:]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)

    # a new request latches the route of its own first call
    t = cache.add_sequence()
    step(cache, [t], [5], gen, num_layers=1)
    assert kernel_calls == [[t]]
    assert cache.mirror.routes == {s: "mirror", t: "direct"}
    assert cache.paged_stats()["kv_quant_route"] == "direct"


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_free_and_reset_forget_routes_and_mirrors():
    gen = torch.Generator().manual_seed(3)
    cache = make_cache(num_layers=1)
    a, b = cache.add_sequence(), cache.add_sequence()
    step(cache, [a, b], [5, 6], gen, num_layers=1)
    cache.free(a)
    assert set(cache.mirror.routes) == {b} and {key[0] for key in cache.mirror.buffers} == {b}
    cache.reset()
    assert not cache.mirror.routes and not cache.mirror.buffers


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_dense_and_turboquant_layers_do_not_use_the_mirror():
    gen = torch.Generator().manual_seed(4)
    for spec in ("off", "turboquant"):
        cache = PagedKVCache(kv_format=spec, block_size=4, num_blocks=32)
        s = cache.add_sequence()
        step(cache, [s], [4], gen, num_layers=1)
        stats = cache.paged_stats()
        assert stats["kv_quant_route"] is None and stats["kv_quant_dequant_tokens"] == 0
        assert not cache.mirror.routes


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_rotated_keys_attend_alike_on_the_mirror_and_over_the_pages(monkeypatch):
    """q4:rotate_keys: the mirror holds keys rotated back (`decode`) and is attended with the queries as they are;
    the pages hold rotated keys, attended with rotated queries. Both give the same output."""
    spec = KVFormat(kind="kvquant", mode="q4", dtype=torch.float32, rotate_keys=True)
    outs = []
    for route in ("mirror", "direct"):
        if route == "direct":
            monkeypatch.setattr(ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
            monkeypatch.setattr("pagedkv.ops.triton.paged_attention", reference.paged_attention)
            monkeypatch.setattr("pagedkv.ops.triton.write_kv", reference.write_kv)
        cache = PagedKVCache(kv_format=spec, block_size=4, num_blocks=32, num_layers=1)
        s = cache.add_sequence()
        outs.append(step(cache, [s], [11], torch.Generator().manual_seed(6), num_layers=1)[0])
        assert cache.paged_stats()["kv_quant_route"] == route
    plain = PagedKVCache(kv_format="q4", block_size=4, num_blocks=32, num_layers=1)
    p = plain.add_sequence()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    assert (step(plain, [p], [11], torch.Generator().manual_seed(6), num_layers=1)[0] - outs[0]).abs().max() > 1e-3
