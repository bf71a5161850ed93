"""Speculative decoding in the engine: greedy outputs are the engine's own without speculation, for every
page format and both drafters, with chunked prefill, preemption and prefix-cache hits in the same run;
rejected drafts leave nothing behind (pool, prefix cache); verify steps replay a graph runner.

The default model runs in float64 here (see the `smollm2_f64` fixture): a verify step computes a token's
keys in a matmul of another shape than a decode step does, which in float32 a quantized format can turn
into another greedy token where two are nearly tied.
"""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.spec import SpeculativeConfig
from pagedkv.errors import ConfigError
from pagedkv.prefix import extend_block_hashes
from test_engine_cuda_graph import EagerReplayRunner, graph_llm, tensor_driven_kernels, tiny_llama  # noqa: F401

# Every page format, TurboQuant with rotated 4-bit keys included (its rotations run in the model's float64:
# a float32 product rounds by how many rows it holds, which once moved a key code between a verify and a
# decode step).
FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys"]
QUESTIONS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
    "Copy the list: apples, pears, plums, cherries, grapes, melons, lemons.",
    "What is the capital of France?",
    "Write a short poem about the sea.",
]


def chat(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True)["input_ids"]


def run(model, tok, kv_format, speculative):
    """Four requests at once on a pool too small for them (admitted without headroom, so preempted), in chunks
    of 32 tokens, then the first two again (their prompts' blocks come from the prefix cache)."""
    llm = LLM(model, tokenizer=tok, kv_format=kv_format, block_size=8, num_blocks=16, max_num_batched_tokens=32,
              speculative=speculative, admission_lookahead_tokens=0)
    prompts = [chat(tok, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16)
    outputs = llm.generate(prompts, params) + llm.generate(prompts[:2], params)
    return llm, outputs


def registered_hashes_are_of_verified_tokens(llm, outputs):
    """Every block hash in the pool is one of a finished request's blocks (prompt + output): no block was
    registered while it held a drafted token that was rejected later."""
    cache = llm.engine.cache
    valid = set()
    for out in outputs:
        valid.update(extend_block_hashes([], out.prompt_token_ids + out.token_ids, cache.block_size,
                                         str(cache.config.kv_format)))
    registered = {h for h in cache.pool.block_hash if h is not None}
    return registered and registered <= valid


@pytest.mark.parametrize("kv_format", FORMATS)
def test_greedy_with_each_drafter_equals_the_engine_without_speculation(smollm2_f64, kv_format):
    model, tok = smollm2_f64
    _, base = run(model, tok, kv_format, None)
    expected = [o.token_ids for o in base]
    drafters = {"ngram": "ngram:k=4",
                "draft": dict(method="draft", draft_model=model, draft_layers=24, num_speculative_tokens=3,
                              adaptive=False)}  # adaptive k would pause a draft this costly (0.84 of the target)
    for name, speculative in drafters.items():
        llm, outputs = run(model, tok, kv_format, speculative)
        assert [o.token_ids for o in outputs] == expected, name
        stats = llm.stats()
        assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0, (name, stats)
        assert stats["spec_accepted_tokens"] > 0 and stats["blocks_used"] == 0, (name, stats)
        accepted = [o.metrics.num_accepted_tokens for o in outputs[:4]]
        assert len(set(accepted)) > 1, (name, accepted)  # acceptance differs per request
        assert llm.engine.cache.paged_stats()["paged_attention_calls_by_phase"]["verify"] > 0
        assert registered_hashes_are_of_verified_tokens(llm, outputs), name
        llm.engine.cache.pool.check()


def test_request_metrics_and_stats_report_acceptance(smollm2):
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, speculative="ngram:k=4,adaptive=0")
    out = llm.generate(chat(tok, QUESTIONS[0]), SamplingParams(max_tokens=24))[0]
    m = out.metrics
    assert m.num_spec_steps > 0 and 0 < m.num_accepted_tokens <= m.num_draft_tokens <= 4 * m.num_spec_steps
    assert m.accepted_tokens_per_step == pytest.approx(m.num_accepted_tokens / m.num_spec_steps)
    stats = llm.stats()
    assert stats["spec_accepted_tokens"] == m.num_accepted_tokens and stats["spec_draft_tokens"] == m.num_draft_tokens
    assert stats["spec_acceptance_rate"] == pytest.approx(m.acceptance_rate, abs=1e-4)
    # each verify step emits its accepted drafts and one token of its own
    assert stats["generated_tokens"] == len(out.token_ids) and stats["steps"] <= 1 + len(out.token_ids) - m.num_accepted_tokens


def test_sampling_with_speculation_keeps_seeded_requests_valid(smollm2):
    model, tok = smollm2
    llm = LLM(model, tokenizer=tok, speculative="ngram:k=4,adaptive=0")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24)
    outs = llm.generate([chat(tok, q) for q in QUESTIONS[:2]], params)
    assert all(len(o.token_ids) == 24 or o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.stats()["spec_verify_steps"] > 0 and llm.stats()["blocks_used"] == 0


def test_a_draft_model_with_another_vocabulary_is_refused(smollm2):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok = smollm2
    other = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ConfigError, match="same tokenizer"):
        LLM(model, tokenizer=tok, speculative=SpeculativeConfig("draft", draft_model=other))
    with pytest.raises(ConfigError, match="only 30 layers"):
        LLM(model, tokenizer=tok, speculative=dict(method="draft", draft_model=model, draft_layers=31))


def test_verify_steps_replay_the_verify_graph_runner(tensor_driven_kernels):  # noqa: F811
    """Verify steps of exactly 1 + k tokens per sequence go through the graph runner (stand-in replay, as in
    test_engine_cuda_graph); drafts are padded to k; the tokens are the eager engine's without speculation."""
    model = tiny_llama()
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model, enforce_eager=True, num_blocks=64, block_size=4)
                .generate(prompts, params)]
    llm = graph_llm(model, num_blocks=64, block_size=4, speculative="ngram:k=3,adaptive=0")
    engine = llm.engine
    engine.runner.verify_graphs = EagerReplayRunner(model, engine.cache, engine.runner.cache_kwarg, (1, 2, 4),
                                                    max_blocks_per_seq=engine.cache.blocks_for(engine.max_model_len),
                                                    query_len=4)
    engine.speculator.fixed_k = True
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert engine.runner.verify_graphs.num_replays > 5
    assert llm.stats()["spec_accepted_tokens"] > 0 and llm.stats()["blocks_used"] == 0
