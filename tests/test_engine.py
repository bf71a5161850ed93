"""The serving engine on the CPU with SmolLM2: continuous batching, chunked prefill, preemption, prefix
caching and sampling give every request the tokens it gets alone, and free every block at the end."""

import bisect

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import ConfigError, ContextWindowError

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "List three primary colors:",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1492, Columbus",
    "My favourite food is",
]
PARAGRAPH = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
             "in want of a wife. However little known the feelings or views of such a man may be on his first "
             "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
             "he is considered the rightful property of some one or other of their daughters. ")


def make_llm(model_and_tokenizer, **options) -> LLM:
    model, tokenizer = model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, **options)


def assert_no_blocks_in_use(llm: LLM):
    stats = llm.stats()
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0
    assert stats["blocks_used"] == 0, stats
    assert llm.engine.cache.seqs == {}
    llm.engine.cache.pool.check()


def test_concurrent_greedy_requests_match_each_alone(model_and_tokenizer):
    # a small token budget chunks the longer prompts and mixes their chunks with other requests' decodes
    llm = make_llm(model_and_tokenizer, num_blocks=128, max_num_batched_tokens=12, prefix_caching=False)
    params = SamplingParams(max_tokens=6)
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    steps_alone = llm.stats()["steps"]
    together = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in together] == alone
    assert all(len(t) == 6 for t in alone)
    assert llm.stats()["steps"] - steps_alone < steps_alone / 2  # they really ran batched
    assert [o.text for o in together] == [model_and_tokenizer[1].decode(t, skip_special_tokens=True) for t in alone]
    assert_no_blocks_in_use(llm)


def test_pool_too_small_for_all_requests_finishes_by_preemption(model_and_tokenizer):
    params = SamplingParams(max_tokens=24)
    reference = make_llm(model_and_tokenizer, num_blocks=64, prefix_caching=False)
    alone = [reference.generate(p, params)[0].token_ids for p in PROMPTS[:4]]
    # each request needs 2-3 blocks of 16 tokens; 6 blocks cannot hold the four of them at once, and without
    # admission headroom they are all admitted and grow into each other
    llm = make_llm(model_and_tokenizer, num_blocks=6, prefix_caching=False, admission_lookahead_tokens=0)
    outputs = llm.generate(PROMPTS[:4], params)
    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == alone
    assert_no_blocks_in_use(llm)


def test_shared_prefix_reuses_cached_blocks_and_output_is_identical(model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    prefix = tokenizer(PARAGRAPH * 8).input_ids[:512]
    first = prefix + tokenizer(" Question: who is the single man?").input_ids
    second = prefix + tokenizer(" Question: what do the families think?").input_ids
    params = SamplingParams(max_tokens=5)
    uncached = make_llm(model_and_tokenizer, num_blocks=128, prefix_caching=False).generate(second, params)[0]

    llm = make_llm(model_and_tokenizer, num_blocks=128, max_num_batched_tokens=1024)
    llm.generate(first, params)
    before = llm.stats()["prefix_cache_hit_tokens"]
    out = llm.generate(second, params)[0]
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] - before >= 496
    assert out.metrics.num_cached_tokens == 512
    assert out.token_ids == uncached.token_ids
    assert_no_blocks_in_use(llm)


def test_prefix_caching_off_never_hits(model_and_tokenizer):
    llm = make_llm(model_and_tokenizer, num_blocks=64, prefix_caching=False)
    prompt = PARAGRAPH
    llm.generate([prompt], SamplingParams(max_tokens=2))
    llm.generate([prompt], SamplingParams(max_tokens=2))
    stats = llm.stats()
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_blocks"] == 0


def test_seeded_sampling_does_not_depend_on_the_batch(model_and_tokenizer):
    llm = make_llm(model_and_tokenizer, num_blocks=128)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=6)
    alone = llm.generate(PROMPTS[0], sampled)[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=6) for i in range(3)]
    together = llm.generate(PROMPTS[:4], [sampled] + others)
    assert together[0].token_ids == alone
    assert llm.generate(PROMPTS[0], sampled)[0].token_ids == alone
    # top_k=1 is greedy whatever the temperature
    greedy = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6))[0].token_ids
    assert llm.generate(PROMPTS[1], SamplingParams(temperature=5.0, top_k=1, max_tokens=6))[0].token_ids == greedy
    assert_no_blocks_in_use(llm)


def test_stop_strings_end_the_output_before_the_stop(model_and_tokenizer):
    llm = make_llm(model_and_tokenizer, num_blocks=64)
    full = llm.generate(PROMPTS[3], SamplingParams(max_tokens=12))[0]
    words = full.text.split()
    assert len(words) >= 3, full.text
    stop = words[2]
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=12, stop=[stop, "zzzz-never"]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)
    assert_no_blocks_in_use(llm)


def test_eos_and_max_tokens_finish_requests(model_and_tokenizer):
    llm = make_llm(model_and_tokenizer, num_blocks=64)
    tokenizer = model_and_tokenizer[1]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
    out = llm.generate(list(chat), SamplingParams(max_tokens=40))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    longer = llm.generate(list(chat), SamplingParams(max_tokens=len(out.token_ids) + 2, ignore_eos=True))[0]
    assert longer.token_ids[:len(out.token_ids)] == out.token_ids  # went on past the end-of-sequence token
    assert len(longer.token_ids) == len(out.token_ids) + 2
    assert longer.outputs[0].finish_reason == "length"
    assert_no_blocks_in_use(llm)


def test_bad_requests_are_refused_before_they_touch_the_engine(model_and_tokenizer):
    llm = make_llm(model_and_tokenizer, num_blocks=8, max_model_len=64)
    with pytest.raises(ContextWindowError, match="context window"):
        llm.generate("word " * 80, SamplingParams(max_tokens=2))
    with pytest.raises(ContextWindowError, match="max_tokens"):
        llm.generate("hello", SamplingParams(max_tokens=64))
    with pytest.raises(ConfigError, match="out of range"):
        llm.generate([[1, 2, 10 ** 9]], SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="num-blocks"):  # 8 blocks of 16 tokens hold 128 tokens
        LLM(model_and_tokenizer[0], tokenizer=model_and_tokenizer[1], num_blocks=2).generate("hi", SamplingParams(max_tokens=40))
    assert not llm.engine.has_unfinished()
    assert llm.generate("hello", SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_abort_frees_blocks_at_once(model_and_tokenizer):
    llm = make_llm(model_and_tokenizer, num_blocks=64)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50))
    other = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3))
    engine.step()
    engine.step()
    assert engine.cache.pool.num_used > 0
    out = engine.abort(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[other].outputs[0].finish_reason == "length"
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("max_num_seqs", [256, 100, 5])
def test_default_graph_buckets_pad_a_decode_batch_by_fewer_than_8_rows(max_num_seqs):
    """A decode batch replays the smallest captured bucket that holds it, and every padded row costs the matrix
    products as much as a real one: no batch the engine can run pads by 8 rows or more (or doubles, below 8)."""
    sizes = EngineConfig(max_num_seqs=max_num_seqs).graph_batch_sizes
    assert sizes == tuple(sorted(sizes)) and sizes[-1] >= max_num_seqs
    for n in range(1, max_num_seqs + 1):
        bucket = sizes[bisect.bisect_left(sizes, n)]
        assert bucket - n < 8 and bucket < 2 * n, (n, bucket)
