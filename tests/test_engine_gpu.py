"""On a CUDA device: decode steps replayed from captured CUDA graphs give the eager engine's tokens,
for every page format (a dense recent window too), with the Triton kernels underneath."""

import random

import pytest
import torch

from pagedkv import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(config).to("cuda", torch.float32).eval()


def workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (7, 100, 33, 250, 16, 61, 2, 140)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 12, 33, 20, 50, 8, 27, 35)]
    return prompts, params


def eager_tokens(model, prompts, params, **options) -> list[list[int]]:
    """Each request's tokens from an engine that runs every step eagerly (no CUDA graph), freed before returning."""
    eager = LLM(model, enforce_eager=True, **options)
    return [o.token_ids for o in eager.generate(prompts, params)]


def assert_mostly_same_tokens(outputs, expected: list[list[int]], whole: int | None = 6) -> None:
    """Identical kernels over padded batches: a rare flip in float32 rounding may change a random model's argmax, so
    more than 97% of the tokens agree (and at least `whole` requests agree throughout, unless None)."""
    same = sum(a == b for o, e in zip(outputs, expected) for a, b in zip(o.token_ids, e))
    total = sum(len(e) for e in expected)
    assert same / total > 0.97, [(o.token_ids, e) for o, e in zip(outputs, expected)]
    if whole is not None:
        assert sum(o.token_ids == e for o, e in zip(outputs, expected)) >= whole


@pytest.mark.parametrize("kv_format,compile_layers", [("off", None), ("q8", None), ("turboquant", None),
                                                     ("off", False), ("q4", False)])
def test_cuda_graph_decode_matches_eager_decode(kv_format, compile_layers):
    """Graphs of compiled layers (the default on CUDA) and of eager layers, against eager steps of eager layers."""
    from torch._dynamo.utils import counters

    model = small_llama()
    prompts, params = workload()
    options = dict(kv_format=kv_format, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128)
    expected = eager_tokens(model, prompts, params, **options)
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(model, cuda_graph_batch_sizes=(1, 2, 4, 8), compile_layers=compile_layers, **options)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["cuda_graph_replays"] > 20, stats
    assert (counters["stats"]["unique_graphs"] > 0) == (compile_layers is None), dict(counters["stats"])
    assert llm.engine.cache.paged_stats()["reference_attention_calls"] == 0  # Triton all the way
    assert_mostly_same_tokens(outputs, expected)
    assert stats["blocks_used"] == 0


@pytest.mark.parametrize("kv_format", ["off", "q4", "turboquant"])
def test_mixed_cuda_graph_steps_match_eager_steps(kv_format):
    """cuda_graph_mixed_tokens: steps of decodes and prompt chunks (a step budget of 48 tokens) replay the mixed
    graphs, captured over compiled layers, and give the eager engine's tokens."""
    model = small_llama()
    prompts, params = workload()
    options = dict(kv_format=kv_format, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=48)
    expected = eager_tokens(model, prompts, params, **options)
    llm = LLM(model, cuda_graph_batch_sizes=(1, 2, 4, 8), cuda_graph_mixed_tokens=48, **options)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["cuda_graph_mixed_replays"] > 5 and stats["cuda_graph_replays"] > 20, stats
    assert llm.engine.cache.paged_stats()["reference_attention_calls"] == 0
    assert_mostly_same_tokens(outputs, expected)
    assert stats["blocks_used"] == 0


@pytest.mark.parametrize("kv_format", ["off", "q8", "turboquant"])
def test_cuda_graph_verify_steps_match_eager_decode(kv_format):
    """Speculative decoding on CUDA: verify steps of 1 + k tokens per sequence are captured and replayed
    (drafts padded to k), and greedy outputs are the eager engine's without speculation."""
    model = small_llama()
    rng = random.Random(1)
    # prompts that repeat themselves, so n-gram lookup finds drafts (a random model also loops on its own)
    prompts = [[rng.randrange(1024) for _ in range(n)] * 3 for n in (5, 9, 3, 17, 2, 11)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 24, 33, 20, 50, 30)]
    options = dict(kv_format=kv_format, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128)
    expected = eager_tokens(model, prompts, params, **options)
    llm = LLM(model, cuda_graph_batch_sizes=(1, 2, 4, 8), speculative="ngram:k=3,adaptive=0", **options)
    outputs = llm.generate(prompts, params)
    runner, stats = llm.engine.runner, llm.stats()
    assert runner.verify_graphs is not None and runner.verify_graphs.query_len == 4
    assert runner.verify_graphs.num_replays > 10 and runner.verify_graphs.num_captures >= 1, stats
    assert stats["spec_accepted_tokens"] > 0, stats
    assert llm.engine.cache.paged_stats()["reference_attention_calls"] == 0  # Triton all the way
    # a verify step computes a token in a matmul of another shape than a decode step
    assert_mostly_same_tokens(outputs, expected, whole=None)
    assert stats["blocks_used"] == 0


def test_penalties_in_captured_decode_steps_match_eager():
    """Presence, frequency and repetition penalties, a logit bias and min_tokens, applied on the device to the
    logits of replayed graphs and to steps queued ahead (before the host has read the tokens they follow)."""
    model = small_llama()
    prompts, _ = workload()
    stop = 7
    params = [SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5),
              SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.6),
              SamplingParams(max_tokens=40, ignore_eos=True, min_tokens=12, stop_token_ids=[stop],
                             logit_bias={stop: 100.0}),
              SamplingParams(max_tokens=28, ignore_eos=True, frequency_penalty=1.5, logit_bias={3: 2.0, 11: -2.0}),
              SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=-0.5, repetition_penalty=0.8,
                             min_tokens=9, stop_token_ids=[stop], logit_bias={stop: 100.0}),
              SamplingParams(max_tokens=26, ignore_eos=True, frequency_penalty=2.0),
              SamplingParams(max_tokens=33, ignore_eos=True, repetition_penalty=1.3, presence_penalty=1.0)]
    options = dict(kv_format="q8", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128)
    eager = LLM(model, enforce_eager=True, **options)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    del eager
    llm = LLM(model, cuda_graph_batch_sizes=(1, 2, 4, 8), **options)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.stats()
    assert stats["cuda_graph_replays"] > 20 and stats["steps_queued_ahead"] > 10, stats
    for i, n in ((2, 12), (5, 9)):  # the bias makes the stop token certain once min_tokens allows it
        assert outputs[i][n:] == [stop] and stop not in outputs[i][:n], outputs[i]
    same = sum(a == b for o, e in zip(outputs, expected) for a, b in zip(o, e))
    # as in the decode test above: padded batches may flip a rare float32 argmax of a random model
    assert same / sum(len(e) for e in expected) > 0.97, (outputs, expected)
    assert sum(o == e for o, e in zip(outputs, expected)) >= 6


@pytest.mark.parametrize("kv_format", ["q8:recent_tokens=32", "q4:recent_tokens=64"])
def test_cuda_graph_decode_with_a_dense_window_matches_eager_decode(kv_format):
    """Captured decode steps write the dense recent window's rings and read them in the Triton decode kernel.
    One request alone first (captured with rings for 4 sequences and scratch), then seven more over buckets of
    1, 2 and 4 (larger batches decode eagerly over the same rings): the rings grow and are captured again."""
    from test_engine_cuda_graph import generate_in_waves

    model = small_llama()
    prompts, params = workload()
    options = dict(kv_format=kv_format, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128)
    expected = generate_in_waves(LLM(model, enforce_eager=True, **options), prompts, params)
    llm = LLM(model, cuda_graph_batch_sizes=(1, 2, 4), **options)
    outputs = generate_in_waves(llm, prompts, params)
    stats, graphs = llm.stats(), llm.engine.runner.graphs
    assert graphs is not None and stats["cuda_graph_replays"] > 20, stats
    assert graphs.num_captures > 1 and llm.engine.cache.window.scratch_row >= 8
    # decode steps read the window in the decode kernel, prefill chunks through dense scratch pages
    stats_pages = llm.engine.cache.paged_stats()
    assert not stats_pages["paged_attention_bailouts_by_phase_reason"], stats_pages
    assert stats_pages["reference_attention_calls"] == 0, stats_pages
    same = sum(a == b for o, e in zip(outputs, expected) for a, b in zip(o, e))
    # as in the decode test above: padded batches may flip a rare float32 argmax of a random model
    assert same / sum(len(e) for e in expected) > 0.97, list(zip(outputs, expected))
    assert sum(o == e for o, e in zip(outputs, expected)) >= 6
    assert stats["blocks_used"] == 0


@pytest.mark.parametrize("k", [1, 3])
def test_cuda_graph_verify_steps_with_a_dense_window_match_eager_verify(k):
    """Verify steps of k drafted tokens read the window in the decode kernel, so they are captured too; the
    eager engine with the same drafts is the reference (a verify step reads the window of its last token)."""
    model = small_llama()
    rng = random.Random(1)
    prompts = [[rng.randrange(1024) for _ in range(n)] * 3 for n in (5, 9, 3, 17, 2, 11)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 24, 33, 20, 50, 30)]
    options = dict(kv_format="q8:recent_tokens=32", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128,
                   speculative=f"ngram:k={k},adaptive=0")
    eager = LLM(model, enforce_eager=True, **options)
    eager.engine.speculator.fixed_k = True  # drafts padded to k, as under graphs
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    del eager
    llm = LLM(model, cuda_graph_batch_sizes=(1, 2, 4, 8), **options)
    outputs = llm.generate(prompts, params)
    runner, stats = llm.engine.runner, llm.stats()
    assert runner.verify_graphs is not None and runner.verify_graphs.query_len == k + 1
    assert runner.verify_graphs.num_replays > 10 and stats["spec_accepted_tokens"] > 0, stats
    bailouts = llm.engine.cache.paged_stats()["paged_attention_bailouts_by_phase_reason"]
    assert not bailouts, bailouts   # prefill chunks read the window through dense scratch pages
    same = sum(a == b for o, e in zip(outputs, expected) for a, b in zip(o.token_ids, e))
    assert same / sum(len(e) for e in expected) > 0.97, [(o.token_ids, e) for o, e in zip(outputs, expected)]
    assert stats["blocks_used"] == 0
