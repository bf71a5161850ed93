"""The dense recent window option (`recent_tokens`): parsing and validation."""

import pytest
import torch

from pagedkv import PagedKVCache
from pagedkv.config import CacheConfig, KVFormat
from pagedkv.errors import ConfigError


@pytest.mark.parametrize("spec, kind, recent", [
    ("turboquant:recent_tokens=128", "turboquant", 128),
    ("turboquant:k=q4_0,v=q4_0,rotate_keys,recent_tokens=64", "turboquant", 64),
    ("q4:recent_tokens=32", "kvquant", 32),
    ("q8", "kvquant", 0),
    ("turboquant", "turboquant", 0),
])
def test_format_string_carries_recent_tokens(spec, kind, recent):
    fmt = KVFormat.parse(spec)
    assert (fmt.kind, fmt.recent_tokens) == (kind, recent)
    assert KVFormat.parse(str(fmt)) == fmt


def test_recent_tokens_zero_keeps_format_string_and_equality():
    assert str(KVFormat.parse("turboquant:recent_tokens=0")) == "turboquant:k=q8_0,v=q3_0"
    assert KVFormat.parse("q4:recent_tokens=0") == KVFormat.parse("q4")
    assert CacheConfig.build(kv_format="q4", recent_tokens=0) == CacheConfig.build(kv_format="q4")


def test_build_takes_recent_tokens_as_option():
    config = CacheConfig.build(kv_format="turboquant", recent_tokens=128)
    assert config.recent_tokens == 128 and config.kv_format.recent_tokens == 128
    assert CacheConfig.build(kv_format="q4:recent_tokens=32", recent_tokens=32).recent_tokens == 32
    seed = CacheConfig.build(kv_format="turboquant:recent_tokens=16", turboquant_config={"k_quant": "q8_0"})
    assert seed.recent_tokens == 16


@pytest.mark.parametrize("options, message", [
    (dict(kv_format="turboquant", recent_tokens=20), "multiple of block_size=16"),
    (dict(kv_format="turboquant:recent_tokens=8", block_size=16), "multiple of block_size=16"),
    (dict(kv_format="turboquant", recent_tokens=-16), ">= 0"),
    (dict(kv_format="turboquant", recent_tokens=True), ">= 0"),
    (dict(kv_format="off", recent_tokens=16), "needs a quantized format"),
    (dict(kv_format="off:recent_tokens=16"), "needs a quantized format"),
    (dict(kv_format="turboquant:recent_tokens=x"), "takes an integer"),
    (dict(kv_format="turboquant:recent_tokens"), "takes an integer"),
    (dict(kv_format="q4:recent_tokens=16", recent_tokens=32), "disagrees"),
])
def test_bad_recent_tokens_name_the_setting(options, message):
    with pytest.raises(ConfigError, match=message):
        CacheConfig.build(**options)


def test_off_accepts_only_zero():
    assert CacheConfig.build(kv_format="off", recent_tokens=0).recent_tokens == 0


# ----------------------------------------------------------------------------------------------
# the window in the cache: rings, block transitions, trim, fork, prefix sharing

H, D, BS = 2, 64, 8
FORMATS = ["turboquant", "q4"]


def window_cache(kv_format="turboquant", recent=16, **options):
    spec = kv_format if recent == 0 else f"{kv_format}:recent_tokens={recent}"
    return PagedKVCache(kv_format=spec, block_size=BS, num_blocks=64, **options)


def append(cache, seq_id, keys, values, queries=None, layers=2):
    """Write keys/values [n, H, D] of one sequence into every layer (layer l gets keys + l); with queries
    [n, 2H, D], return each layer's attention output."""
    meta = cache.begin_step([seq_id], [keys.shape[0]])
    outs = []
    for layer in range(layers):
        cache.write(layer, keys + layer, values - layer, meta)
        if queries is not None:
            outs.append(cache.attention(layer, queries, scale=D ** -0.5, meta=meta))
    cache.end_forward()
    return outs


def quantized(cache, keys, values, layer=0):
    """keys/values [n, H, D] through the layer's format: encoded, then decoded (what the pages give back)."""
    fmt = cache.formats[layer]
    return fmt.decode(fmt.encode(keys, values))


def expected_kv(cache, keys, values, first_dense, layer=0):
    """What attention should see: positions before `first_dense` quantized, the rest exact."""
    qk, qv = quantized(cache, keys + layer, values - layer, layer)
    k, v = (keys + layer).clone(), (values - layer).clone()
    k[:first_dense], v[:first_dense] = qk[:first_dense], qv[:first_dense]
    return k, v


def test_no_window_has_no_rings_and_attention_is_the_pages_reference_bit_for_bit():
    from pagedkv.ops import reference

    torch.manual_seed(0)
    cache = window_cache(recent=0)
    assert cache.window is None
    s = cache.add_sequence()
    keys, values, queries = torch.randn(37, H, D), torch.randn(37, H, D), torch.randn(37, 2 * H, D)
    append(cache, s, keys[:30], values[:30])
    meta = cache.begin_step([s], [7])
    assert meta.window is None
    cache.write(0, keys[30:], values[30:], meta)
    out = cache.attention(0, queries[30:], scale=0.125, meta=meta)
    expected = reference.paged_attention(queries[30:], cache.pages[0], cache.formats[0], meta, scale=0.125)
    assert torch.equal(out, expected)
    stats = cache.paged_stats()
    assert "window_bytes" not in stats and stats["bytes_per_token"] == 2 * cache.formats[0].bytes_per_token()


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("steps", [[37], [20, 1, 16], [1] * 29, [8, 8, 8, 5]])
def test_attention_reads_the_window_exact_and_the_rest_from_the_pages(kv_format, steps):
    from pagedkv.ops import reference

    torch.manual_seed(1)
    n = sum(steps)
    keys, values, queries = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(n, 2 * H, D)
    cache = window_cache(kv_format, recent=16)
    s = cache.add_sequence()
    pos = 0
    for step in steps:
        outs = append(cache, s, keys[pos:pos + step], values[pos:pos + step], queries[pos:pos + step])
        pos += step
        first_dense = max(0, (pos - 16) // BS) * BS  # the last 16 .. 23 tokens stay exact
        for layer, out in enumerate(outs):
            k, v = expected_kv(cache, keys[:pos], values[:pos], first_dense, layer)
            if kv_format == "q4":  # the KV-Quant mirror holds decoded tokens in its own dtype
                mirror = cache.formats[layer].mirror_dtype
                k[:first_dense], v[:first_dense] = k[:first_dense].to(mirror), v[:first_dense].to(mirror)
            want = reference.attend(queries[pos - step:pos], k, v, scale=D ** -0.5, sliding_window=None, softcap=None)
            torch.testing.assert_close(out, want)
            read_k, read_v = cache.read(s, layer)
            torch.testing.assert_close(read_k, expected_kv(cache, keys[:pos], values[:pos], first_dense, layer)[0],
                                       rtol=0, atol=0)
    # the window changed something: the exact tail differs from its quantized copy
    k_all_quantized, _ = quantized(cache, keys, values)
    assert not torch.equal(cache.read(s, 0)[0][-8:], k_all_quantized[-8:])


def test_triton_requested_falls_back_to_the_reference_path_with_a_reason(monkeypatch):
    """Without the dense-scratch prefill (`tuning.DENSE_PREFILL`, which reads the window: tests/triton), a
    prefill chunk over a window runs the reference path."""
    from pagedkv import ops
    from pagedkv.ops.triton import tuning

    monkeypatch.setattr(tuning, "DENSE_PREFILL", False)
    cache = window_cache(recent=16)
    s = cache.add_sequence()
    meta = cache.begin_step([s], [20])
    cache.write(0, torch.randn(20, H, D), torch.randn(20, H, D), meta)
    monkeypatch.setattr(ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
    cache.attention(0, torch.randn(20, 2 * H, D), scale=0.125, meta=meta)
    stats = cache.paged_stats()
    assert stats["triton_attention_calls"] == 0 and stats["reference_attention_calls"] == 1
    assert stats["paged_attention_bailouts_by_phase_reason"] == {"prefill:recent_tokens": 1}


def test_decode_over_pages_the_decode_kernel_does_not_read_falls_back_with_a_reason(monkeypatch):
    """TurboQuant at head_dim 64: the decode kernel, which reads the window, reads it at 128 only (and without
    `tuning.DENSE_PREFILL`, which would take these steps through dense scratch pages: tests/triton)."""
    from pagedkv import ops
    from pagedkv.ops import reference
    from pagedkv.ops.triton import tuning

    monkeypatch.setattr(tuning, "DENSE_PREFILL", False)
    cache = window_cache(recent=16)
    s = cache.add_sequence()
    monkeypatch.setattr(ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
    monkeypatch.setattr("pagedkv.ops.triton.write_kv", reference.write_kv)
    for n in (20, 1):
        meta = cache.begin_step([s], [n])
        cache.write(0, torch.randn(n, H, D), torch.randn(n, H, D), meta)
        cache.attention(0, torch.randn(n, 2 * H, D), scale=0.125, meta=meta)
        cache.end_forward()
    stats = cache.paged_stats()
    assert stats["triton_attention_calls"] == 0
    assert stats["paged_attention_bailouts_by_phase_reason"] == {"prefill:recent_tokens": 1, "decode:recent_tokens": 1}


def test_every_token_is_encoded_once_and_pages_equal_encoding_each_block_directly(monkeypatch):
    torch.manual_seed(2)
    cache = window_cache(recent=16)
    s = cache.add_sequence()
    keys, values = torch.randn(45, H, D), torch.randn(45, H, D)
    append(cache, s, keys[:1], values[:1], layers=1)  # creates the format
    fmt = cache.formats[0]
    encoded = []
    real_encode = fmt.encode
    monkeypatch.setattr(fmt, "encode", lambda k, v: encoded.append(k.shape[0]) or real_encode(k, v))
    for p in range(1, 45):  # decode steps: blocks 0..3 leave the window one after the other
        append(cache, s, keys[p:p + 1], values[p:p + 1], layers=1)
    assert sum(encoded) == 44  # no block is encoded again when it leaves the window
    direct = real_encode(keys, values)
    table = cache.block_table(s)
    for name, page in cache.pages[0].items():
        got = page[table].reshape(-1, *page.shape[2:])[:45]
        assert torch.equal(got.view(torch.uint8), direct[name].view(torch.uint8)), name
    k, _ = cache.read(s, 0)
    first_dense = (45 - 16) // BS * BS
    assert torch.equal(k[first_dense:], keys[first_dense:])
    assert torch.equal(k[:first_dense], fmt.decode(direct)[0][:first_dense])


def test_trim_across_the_window_edge_reads_only_blocks_the_ring_holds_whole():
    torch.manual_seed(3)
    cache = window_cache(recent=16)  # ring of 3 blocks of 8
    s = cache.add_sequence()
    keys, values = torch.randn(40, H, D), torch.randn(40, H, D)
    append(cache, s, keys, values, layers=1)  # ring: blocks 2, 3, 4
    assert cache.trim(20, s) == 20
    k, _ = cache.read(s, 0)  # length 20: the window starts at block 0, the ring holds block 2 (16..19)
    assert torch.equal(k, expected_kv(cache, keys[:20], values[:20], 16)[0])
    cache.trim(8, s)  # length 12: block 1 (8..11) is no longer held whole by the ring
    assert torch.equal(cache.read(s, 0)[0], expected_kv(cache, keys[:12], values[:12], 12)[0])
    new_k, new_v = torch.randn(18, H, D), torch.randn(18, H, D)
    append(cache, s, new_k, new_v, layers=1)  # length 30: the window starts at block 1
    want_k, want_v = torch.cat([keys[:12], new_k]), torch.cat([values[:12], new_v])
    # block 1 mixes kept and rewritten positions: its ring slot held block 4 before, so it is read quantized;
    # blocks 2 and 3 were written whole after the trim
    got_k, got_v = cache.read(s, 0)
    assert torch.equal(got_k, expected_kv(cache, want_k, want_v, 16)[0])
    assert torch.equal(got_v, expected_kv(cache, want_k, want_v, 16)[1])
    append(cache, s, torch.randn(8, H, D), torch.randn(8, H, D), layers=1)  # length 38: block 1 left the window
    assert cache.window.first_dense_block(s, 38) == 2


def test_speculative_rollback_inside_the_last_block_keeps_the_window_exact():
    torch.manual_seed(4)
    cache = window_cache(recent=16)
    s = cache.add_sequence()
    keys, values = torch.randn(40, H, D), torch.randn(40, H, D)
    append(cache, s, keys[:30], values[:30], layers=1)
    append(cache, s, torch.randn(4, H, D), torch.randn(4, H, D), layers=1)  # drafted tokens, rejected
    cache.trim(4, s)
    append(cache, s, keys[30:], values[30:], layers=1)
    assert torch.equal(cache.read(s, 0)[0], expected_kv(cache, keys, values, 24)[0])


def test_fork_gives_the_child_its_own_copy_of_the_ring():
    torch.manual_seed(5)
    cache = window_cache(recent=16)
    parent = cache.add_sequence()
    keys, values = torch.randn(30, H, D), torch.randn(30, H, D)
    append(cache, parent, keys, values)
    child = cache.fork(parent)
    assert cache.window.rings[child].row != cache.window.rings[parent].row
    tails = {sid: (torch.randn(12, H, D), torch.randn(12, H, D)) for sid in (parent, child)}
    for sid, (k, v) in tails.items():
        append(cache, sid, k, v)
    for sid, (k, v) in tails.items():
        want_k, want_v = torch.cat([keys, k]), torch.cat([values, v])
        for layer in range(2):
            got_k, got_v = cache.read(sid, layer)
            ek, ev = expected_kv(cache, want_k, want_v, (42 - 16) // BS * BS, layer)
            assert torch.equal(got_k, ek) and torch.equal(got_v, ev)
    cache.free(parent)
    assert parent not in cache.window.rings and cache.window.free_rows


def test_a_sequence_on_shared_prefix_blocks_reads_them_quantized_and_its_own_tokens_exact():
    torch.manual_seed(6)
    cache = window_cache(recent=16)
    a = cache.add_sequence()
    keys, values = torch.randn(40, H, D), torch.randn(40, H, D)
    append(cache, a, keys[:24], values[:24])
    prefix = cache.block_table(a)[:2]
    cache.pool.incref(prefix)
    b = cache.add_sequence(prefix_block_ids=prefix)  # blocks 0, 1 shared: quantized once, by `a`
    append(cache, b, keys[16:40], values[16:40])  # b: tokens 0..15 from the pages, 16..39 its own
    assert cache.block_table(b)[:2] == prefix and cache.pool.ref_cnt[prefix[0]] == 2
    got_k, _ = cache.read(b, 1)
    assert torch.equal(got_k, expected_kv(cache, keys, values, 24, layer=1)[0])
    shared = cache.block_table(a)[:3]
    cache.pool.incref(shared)
    c = cache.add_sequence(prefix_block_ids=shared)
    append(cache, c, keys[24:28], values[24:28])  # length 28: the window would start at block 1, but
    assert cache.window.first_dense_block(c, 28) == 3  # blocks 1 and 2 came from the prefix (quantized)
    assert torch.equal(cache.read(c, 0)[0], expected_kv(cache, keys[:28], values[:28], 24)[0])


def test_snapshots_carry_the_pages_only_and_restore_across_windows():
    torch.manual_seed(7)
    cache = window_cache(recent=16)
    s = cache.add_sequence()
    keys, values = torch.randn(40, H, D), torch.randn(40, H, D)
    append(cache, s, keys[:30], values[:30])
    snap = cache.snapshot(s)
    assert "recent_tokens" not in str(snap.identity)  # the window does not change the pages' bytes
    restored = cache.restore(snap)
    # the ring is not in the snapshot: the restored tokens are read from the pages
    assert torch.equal(cache.read(restored, 0)[0], expected_kv(cache, keys[:30], values[:30], 30)[0])
    append(cache, restored, keys[30:], values[30:])  # length 40: window from block 3; block 3 mixes restored tokens
    assert torch.equal(cache.read(restored, 1)[0], expected_kv(cache, keys, values, 32, layer=1)[0])
    append(cache, s, keys[30:], values[30:])
    assert torch.equal(cache.read(s, 1)[0], expected_kv(cache, keys, values, 24, layer=1)[0])
    plain = window_cache(recent=0)  # the same pages without a window
    p = plain.restore(snap)
    assert torch.equal(plain.read(p, 0)[0], expected_kv(cache, keys[:30], values[:30], 30)[0])


def test_stats_count_the_window_bytes():
    cache = window_cache(recent=16, dtype="fp32")
    s, t = cache.add_sequence(), cache.add_sequence()
    append(cache, s, torch.randn(20, H, D), torch.randn(20, H, D))
    append(cache, t, torch.randn(12, H, D), torch.randn(12, H, D))
    stats = cache.paged_stats()
    ring = 2 * 3 * BS * H * D * 4  # keys and values, 3 blocks, float32, per layer
    assert stats["recent_tokens"] == 16 and stats["window_sequences"] == 2
    assert stats["window_bytes_in_use"] == 2 * 2 * ring
    assert stats["window_bytes"] >= stats["window_bytes_in_use"]
    pages = sum(p.numel() * p.element_size() for layer in cache.pages for p in layer.values())
    assert stats["bytes"] == pages + stats["window_bytes"]
    per_token = sum(f.bytes_per_token() for f in cache.formats)
    assert stats["bytes_per_token"] == pytest.approx(per_token + 2 * 2 * ring / 32)
    cache.free(s)
    assert cache.paged_stats()["window_bytes_in_use"] == 2 * ring


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5])
def test_a_steps_window_plan_starts_each_tensor_on_16_bytes(num_seqs):
    """Triton compiles a kernel once per 16-byte alignment of its pointer arguments: the plan's per-sequence
    tensors (one upload) start aligned whatever the batch size, so eager steps do not compile again mid-stream."""
    cache = window_cache(recent=16)
    seqs = [cache.add_sequence() for _ in range(num_seqs)]
    meta = cache.begin_step(seqs, [20 + i for i in range(num_seqs)])
    plan = meta.window
    for t, host in [(plan.rows, plan.rows_cpu), (plan.first_block, plan.first_block_cpu)]:
        assert t.data_ptr() % 16 == 0 and t.tolist() == host and len(host) == num_seqs


def test_rings_keep_a_scratch_row_that_no_sequence_holds():
    """The rings' last row is scratch (CUDA-graph padding writes there); `reserve` grows every layer's rings to
    a capacity, keeping what they hold."""
    cache = window_cache(recent=16)
    seqs = [cache.add_sequence() for _ in range(4)]
    for s in seqs:
        append(cache, s, torch.randn(20, H, D), torch.randn(20, H, D))
    window = cache.window
    rows = [window.rings[s].row for s in seqs]
    assert max(rows) < window.scratch_row == window.keys[0].shape[0] - 1
    before = [cache.read(s, layer) for s in seqs for layer in range(len(cache.pages))]
    window.reserve(9)
    assert window.scratch_row >= 9 and {k.shape[0] for k in window.keys.values()} == {window.scratch_row + 1}
    after = [cache.read(s, layer) for s in seqs for layer in range(len(cache.pages))]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(after, before))


def test_reset_forgets_every_ring():
    cache = window_cache(recent=16)
    s = cache.add_sequence()
    append(cache, s, torch.randn(20, H, D), torch.randn(20, H, D))
    cache.reset()
    assert cache.window.rings == {} and cache.paged_stats()["window_bytes_in_use"] == 0
    s = cache.add_sequence()
    keys, values = torch.randn(20, H, D), torch.randn(20, H, D)
    append(cache, s, keys, values)
    assert torch.equal(cache.read(s, 0)[0], expected_kv(cache, keys, values, 0)[0])


# ----------------------------------------------------------------------------------------------
# the window in the engine (the default model on the CPU)

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
           "def fibonacci(n):", "List three primary colors:"]
SHARED = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
          "in want of a wife. However little known the feelings or views of such a man may be")


def engine(model_and_tokenizer, kv_format, **options):
    from pagedkv import LLM

    model, tokenizer = model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, kv_format=kv_format, block_size=8, **options)


def test_a_window_longer_than_every_sequence_generates_what_dense_pages_do(model_and_tokenizer):
    from pagedkv import SamplingParams

    params = SamplingParams(max_tokens=20)  # prompts of 5..15 tokens: every sequence stays within 40 tokens
    dense = engine(model_and_tokenizer, "off", num_blocks=64).generate(PROMPTS, params)
    quantized = engine(model_and_tokenizer, "turboquant", num_blocks=64).generate(PROMPTS, params)
    windowed = engine(model_and_tokenizer, "turboquant:recent_tokens=40", num_blocks=64).generate(PROMPTS, params)
    assert [o.token_ids for o in windowed] == [o.token_ids for o in dense]
    assert [o.token_ids for o in quantized] != [o.token_ids for o in dense]  # the window is what made them equal


@pytest.mark.parametrize("kv_format", ["turboquant:recent_tokens=16", "q4:recent_tokens=16"])
def test_preempted_requests_recompute_to_the_same_greedy_tokens(model_and_tokenizer, kv_format):
    from pagedkv import SamplingParams

    params = SamplingParams(max_tokens=18)
    roomy = engine(model_and_tokenizer, kv_format, num_blocks=64, prefix_caching=False)
    alone = [roomy.generate(p, params)[0].token_ids for p in PROMPTS]
    # 6 blocks of 8 cannot hold four requests of up to 33 tokens: they are admitted and grow into each other
    llm = engine(model_and_tokenizer, kv_format, num_blocks=6, prefix_caching=False, admission_lookahead_tokens=0)
    outputs = llm.generate(PROMPTS, params)
    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == alone
    assert llm.engine.cache.window.rings == {} and llm.stats()["blocks_used"] == 0


def test_a_prefix_cache_hit_stops_where_the_window_starts(model_and_tokenizer):
    from pagedkv import SamplingParams

    tokenizer = model_and_tokenizer[1]
    shared = tokenizer(SHARED).input_ids[:48]
    prompts = [shared + tokenizer(" Who said this?").input_ids, shared + tokenizer(" Is it true?").input_ids]
    params = SamplingParams(max_tokens=4)
    expected = engine(model_and_tokenizer, "turboquant:recent_tokens=16", num_blocks=32,
                      prefix_caching=False).generate(prompts[1], params)[0].token_ids
    llm = engine(model_and_tokenizer, "turboquant:recent_tokens=16", num_blocks=32)
    llm.generate(prompts[0], params)
    out = llm.generate(prompts[1], params)[0]
    # 6 shared blocks are cached, but blocks from (len - 16) // 8 on are computed so the window is dense
    assert out.metrics.num_cached_tokens == (len(prompts[1]) - 16) // 8 * 8 < 48
    assert out.token_ids == expected
    assert llm.stats()["blocks_used"] == 0


def test_samples_of_one_prompt_fork_the_window(model_and_tokenizer):
    from pagedkv import SamplingParams

    llm = engine(model_and_tokenizer, "turboquant:recent_tokens=16", num_blocks=64, prefix_caching=False)
    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    (out,) = llm.generate(PROMPTS[1], params)  # the samples fork from the prompt, ring included
    singles = llm.generate([PROMPTS[1]] * 3, [params.for_sample(i) for i in range(3)])
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.cache.window.rings == {}


def test_a_padded_transformers_batch_inside_the_window_equals_dynamic_cache(smollm2):
    from transformers import DynamicCache

    from pagedkv import install_paged_kv_cache
    from pagedkv.hf import cache_kwarg

    model, tok = smollm2
    tok.padding_side = "left"
    enc = tok(["Hi!", "Give me a long list of fruits and their colors, please.", "Water boils at"],
              return_tensors="pt", padding=True)
    assert len(set(enc.attention_mask.sum(1).tolist())) == 3  # rows of three lengths: padded steps

    def greedy(cache):
        out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=20, do_sample=False,
                             min_new_tokens=20, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                             **{cache_kwarg(model): cache})
        return out.sequences, torch.stack([s.float().log_softmax(-1) for s in out.scores], dim=1)

    with torch.inference_mode():
        ref_seq, ref_lp = greedy(DynamicCache())
        cache = install_paged_kv_cache(model, kv_format="turboquant:recent_tokens=48", block_size=8)
        seq, lp = greedy(cache)  # every row stays within 48 tokens: all of them read exact
    assert torch.equal(seq, ref_seq)
    assert (lp - ref_lp).nan_to_num(0, 0, 0).abs().max().item() <= 1e-3
    assert max(cache.seq_len(s) for s in cache.batch_seq_ids) <= 48


def test_recent_tokens_flag_reaches_the_cache_options():
    from pagedkv.cli import build_parser
    from pagedkv.options import cache_options

    parser = build_parser()
    args = parser.parse_args(["generate", "--paged-kv-quantization", "q4", "--recent-tokens", "32", "hi"])
    opts = cache_options(args)
    assert opts["recent_tokens"] == 32 and PagedKVCache(**opts).config.recent_tokens == 32
    assert cache_options(parser.parse_args(["generate", "hi"]))["recent_tokens"] is None
    with pytest.raises(ConfigError, match="multiple of block_size=16"):
        cache_options(parser.parse_args(["generate", "--paged-kv-quantization", "q4", "--recent-tokens", "20", "hi"]))
    with pytest.raises(ConfigError, match="needs a quantized format"):
        cache_options(parser.parse_args(["generate", "--recent-tokens", "16", "hi"]))


def test_speculative_rollbacks_with_a_window_keep_the_greedy_tokens(smollm2_f64):
    """Drafts are written, partly rejected and trimmed inside the window. A verify step reads the window of
    its last drafted token, a decode step its own: the logits differ by a block's quantization at most,
    which does not move these greedy tokens (float64, as in test_engine_spec)."""
    import test_engine_spec

    model, tok = smollm2_f64
    _, base = test_engine_spec.run(model, tok, "turboquant:recent_tokens=16", None)
    llm, outputs = test_engine_spec.run(model, tok, "turboquant:recent_tokens=16", "ngram:k=4")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    stats = llm.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["prefix_cache_hits"] > 0 and stats["blocks_used"] == 0
    assert llm.engine.cache.paged_stats()["paged_attention_calls_by_phase"]["verify"] > 0
    assert llm.engine.cache.window.rings == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_triton_writes_the_pages_and_decode_reads_the_window_in_the_kernel():
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv import LLM, SamplingParams
    from pagedkv.ops import reference

    torch.manual_seed(8)  # q4: the decode kernel reads it at head_dim 64 (TurboQuant at 128)
    cache = PagedKVCache(kv_format="q4:recent_tokens=16", block_size=BS, num_blocks=64, device="cuda")
    s = cache.add_sequence()
    keys, values = torch.randn(45, H, D, device="cuda"), torch.randn(45, H, D, device="cuda")
    for start, stop in [(0, 20), (20, 21), (21, 45)]:
        meta = cache.begin_step([s], [stop - start], device="cuda")
        cache.write(0, keys[start:stop], values[start:stop], meta)
        q = torch.randn(stop - start, 2 * H, D, device="cuda")
        out = cache.attention(0, q, scale=0.125, meta=meta)
        cache.end_forward()
        k, v = cache.read(s, 0)
        first_dense = max(0, (stop - 16) // BS) * BS
        assert torch.equal(k[first_dense:], keys[first_dense:stop])
        assert torch.equal(v[first_dense:], values[first_dense:stop])
        torch.testing.assert_close(out, reference.attend(q, k, v, scale=0.125, sliding_window=None, softcap=None),
                                   rtol=1e-4, atol=1e-5)
    stats = cache.paged_stats()  # the decode step in the decode kernel, the longer steps through dense scratch
    assert stats["triton_attention_calls"] == 3 and stats["reference_attention_calls"] == 0
    assert not stats["paged_attention_bailouts_by_phase_reason"]

    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,  # head_dim 128
                         eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).to("cuda", torch.float32).eval()
    prompts = [[(7 * i + j) % 1024 for j in range(n)] for i, n in enumerate((7, 100, 33, 61))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(model, kv_format="turboquant:recent_tokens=32", num_blocks=256, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert llm.stats()["cuda_graph_replays"] > 10  # decode steps captured with the window
    stats = llm.engine.cache.paged_stats()
    assert stats["triton_attention_calls"] > 0
    assert all(not reason.startswith("decode:") for reason in stats["paged_attention_bailouts_by_phase_reason"])


def test_eval_formats_take_recent_tokens_after_format_options():
    from pagedkv.evaluate import parse_formats

    formats = parse_formats("off,turboquant:k=q4_0,v=q4_0,rotate_keys,recent_tokens=32,q4:recent_tokens=16")
    assert [str(f.kv_format) for f in formats] == [
        "off", "turboquant:k=q4_0,v=q4_0,rotate_keys,recent_tokens=32", "q4:recent_tokens=16"]


def test_beam_search_inside_the_window_equals_dynamic_cache():
    """Beams fork and free sequences every step (`reorder_cache`): each fork copies the ring, so with every
    sequence inside the window the beams are those of dense keys/values."""
    from transformers import DynamicCache

    import test_hf_beam
    from pagedkv import install_paged_kv_cache

    model = test_hf_beam.tiny_llama()
    expected = test_hf_beam.beam_search(model, DynamicCache(config=model.config), 3)
    quantized = test_hf_beam.beam_search(model, install_paged_kv_cache(model, kv_format="turboquant:k=q4_0,v=q3_0",
                                                                       block_size=4, num_blocks=256), 3)
    paged = install_paged_kv_cache(model, kv_format="turboquant:k=q4_0,v=q3_0,recent_tokens=24", block_size=4,
                                   num_blocks=256)
    got = test_hf_beam.beam_search(model, paged, 3)  # 11 prompt + 10 new tokens <= 24
    assert torch.equal(got, expected)
    assert not torch.equal(quantized, expected)  # without the window these 4-bit keys change the beams
    assert len(paged.window.rings) == 6  # the batch's 2 x 3 beams


def test_a_tensor_parallel_follower_writes_and_reads_the_rings_the_leader_plans():
    """The leader's steps carry the window's plan, its ring rows and the rows its forks copied: a follower
    (no sequences of its own) fed the same keys/values holds the same rings and attends the same."""
    from pagedkv.ops import reference
    from pagedkv.parallel import ShardedPagedKVCache

    torch.manual_seed(9)
    options = dict(kv_format="turboquant:recent_tokens=16", block_size=BS, num_blocks=2, dynamic=True)
    leader, follower = ShardedPagedKVCache(**options), ShardedPagedKVCache(**options)

    def step(seq_ids, counts):
        meta = leader.begin_step(seq_ids, counts)
        follower.follow_step(leader.export_step(), torch.device("cpu"))
        n = sum(counts)
        k, v, q = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(n, 2 * H, D)
        outs = []
        for cache in (leader, follower):
            cache.write(0, k, v)
            outs.append(cache.attention(0, q, scale=0.125))
            cache.end_forward()
        assert meta.window is not None and torch.equal(outs[0], outs[1])
        for seq_id, ring in leader.window.rings.items():  # what each sequence reads from its ring
            length = leader.seq_len(seq_id)
            first = leader.window.first_dense_block(seq_id, length)
            for lw, fw in zip(leader.window.layer(0), follower.window.layer(0)):
                assert torch.equal(reference.gather_ring(lw, ring.row, first, length, BS),
                                   reference.gather_ring(fw, ring.row, first, length, BS))
        return meta


    a = leader.add_sequence()
    step([a], [30])
    b = leader.fork(a)  # b's ring: a copy of a's row, made on the follower at the next step
    assert step([a, b], [1, 1]).window.first_block_cpu == [1, 1]  # b reads blocks 1..3 from its copied ring
    step([b], [12])
    leader.trim(9, seq_id=b)
    step([a, b], [9, 3])
    leader.free(a)
    c = leader.add_sequence()  # takes a's ring row again
    step([b, c], [1, 20])
    assert leader.window.rings[c].row == 0 and follower.window.num_rows == leader.window.num_rows == 2
