"""The decode runner's static buffers, buckets and padding, on the CPU.

A captured graph replays its kernels over whatever the static buffers hold at replay time. Here a
stand-in "graph" re-runs the forward over the same static buffers, and attention/writes read only
the metadata tensors (never the host-side lists), as the Triton kernels do. Batches that shrink and
grow across buckets, sequences that gain blocks mid-decode and a pool that reallocates its pages
must give exactly the eager engine's tokens. (The real capture runs in tests/test_engine_gpu.py.)
"""

import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import pagedkv.ops
import pagedkv.ops.triton
from pagedkv import LLM, SamplingParams
from pagedkv.engine.cuda_graph import CUDAGraphRunner
from pagedkv.ops import reference


def _tensor_driven_write(pages, fmt, key, value, meta):
    keep = (meta.slot_mapping >= 0).nonzero().flatten()  # padding rows have slot -1
    reference.write_kv(pages, fmt, key, value, dataclasses.replace(meta, token_index=keep))


def _tensor_driven_attention(query, pages, fmt, meta, **kwargs):
    exact = dataclasses.replace(meta, seq_lens_cpu=meta.seq_lens.tolist(),
                                query_start_loc_cpu=meta.query_start_loc.tolist())
    return reference.paged_attention(query, pages, fmt, exact, **kwargs)


class _Replay:
    def __init__(self, fn):
        self.replay = fn


class EagerReplayRunner(CUDAGraphRunner):
    """Captures nothing: replay runs the forward again over the static buffers."""

    def _capture(self, bs):
        logits = self._forward(bs).clone()

        def replay():
            self.cache.plan = self._metadata(bs)
            try:
                logits.copy_(self._forward(bs))
            finally:
                self.cache.end_forward()

        return _Replay(replay), logits


@pytest.fixture
def tensor_driven_kernels(monkeypatch):
    monkeypatch.setattr(pagedkv.ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
    monkeypatch.setattr(pagedkv.ops.triton, "write_kv", _tensor_driven_write)
    monkeypatch.setattr(pagedkv.ops.triton, "paged_attention", _tensor_driven_attention)


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def requests():
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 3, 33, 9, 12)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 5, 21, 9, 2, 17)]
    return prompts, params


def graph_llm(model, batch_sizes=(1, 2, 4), **options):
    """An LLM whose decode steps go through the graph runner, with the stand-in replay; max_num_seqs is
    the largest bucket."""
    llm = LLM(model, cuda_graph_batch_sizes=batch_sizes, max_num_seqs=max(batch_sizes), **options)
    runner = llm.engine.runner
    runner.graphs = EagerReplayRunner(model, llm.engine.cache, runner.cache_kwarg, batch_sizes,
                                      max_blocks_per_seq=llm.engine.cache.blocks_for(llm.engine.max_model_len))
    return llm


@pytest.mark.parametrize("options", [dict(num_blocks=64, block_size=4), dict(dynamic=True, block_size=4)])
def test_graph_decode_matches_eager(tensor_driven_kernels, options):
    model = tiny_llama()
    prompts, params = requests()
    eager = LLM(model, enforce_eager=True, max_num_seqs=4, **options).generate(prompts, params)
    llm = graph_llm(model, **options)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    graphs = llm.engine.runner.graphs
    assert graphs.num_replays > 20  # decode steps went through the buckets, not the eager path
    assert llm.stats()["steps_queued_ahead"] > 10  # and most were queued behind the step in flight
    if options.get("dynamic"):
        assert llm.engine.cache.grow_events > 0 and graphs.num_captures > 1  # re-captured over the new pages
    assert llm.stats()["blocks_used"] == 0


def test_a_full_batch_is_queued_ahead_while_requests_wait(tensor_driven_kernels):
    """Under load (max_num_seqs running, more waiting) the scheduler would admit nobody: steps are still
    queued behind the one in flight, and every request gets the eager engine's tokens."""
    model = tiny_llama()
    prompts, _ = requests()
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 18, 30, 12, 20, 16)]
    eager = LLM(model, enforce_eager=True, max_num_seqs=2, num_blocks=64, block_size=4).generate(prompts, params)
    llm = graph_llm(model, batch_sizes=(1, 2), num_blocks=64, block_size=4)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    stats = llm.stats()
    # 120 tokens over 2 slots: about 60 decode steps, all but the ones around admissions queued ahead
    # (only the last two requests run without anyone waiting, 16-20 steps)
    assert stats["steps_queued_ahead"] > 40, stats
    assert stats["blocks_used"] == 0


def test_full_pool_in_a_graph_step_preempts_and_recovers(tensor_driven_kernels):
    model = tiny_llama()
    prompts, params = requests()
    reference_tokens = [o.token_ids for o in LLM(model, enforce_eager=True, num_blocks=64, block_size=4)
                        .generate(prompts, params)]
    # not enough blocks for four requests at once; admitted without headroom, they grow into each other
    llm = graph_llm(model, num_blocks=14, block_size=4, admission_lookahead_tokens=0)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == reference_tokens
    assert llm.stats()["preemptions"] > 0 and llm.stats()["blocks_used"] == 0


def test_steps_queued_ahead_drop_tokens_of_requests_that_stopped(tensor_driven_kernels):
    """Stop tokens end requests at steps the engine cannot foresee: the step queued behind them is dropped."""
    model = tiny_llama()
    prompts, _ = requests()
    eager_llm = LLM(model, enforce_eager=True, num_blocks=64, block_size=4)
    free_run = eager_llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    params = [SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[o.token_ids[3 + i]])
              for i, o in enumerate(free_run)]
    expected = [o.token_ids for o in eager_llm.generate(prompts, params)]
    assert any(len(t) < 20 for t in expected)
    llm = graph_llm(model, num_blocks=64, block_size=4)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert [o.outputs[0].finish_reason for o in outputs] == [("stop" if len(t) < 20 else "length") for t in expected]
    assert llm.engine.runner.graphs.num_replays > 5 and llm.stats()["blocks_used"] == 0


def test_abort_while_a_step_is_in_flight(tensor_driven_kernels):
    model = tiny_llama()
    prompts, _ = requests()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = LLM(model, enforce_eager=True, num_blocks=64, block_size=4).generate(prompts[0], params)[0].token_ids
    engine = graph_llm(model, num_blocks=64, block_size=4).engine
    keep = engine.add_request(prompts[0], params)
    drop = engine.add_request(prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
    while engine._in_flight is None:
        engine.step()
    assert engine.abort(drop).outputs[0].finish_reason == "abort"
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[keep].token_ids == expected and drop not in done
    assert engine.cache.pool.num_used == 0 and not engine.cache.seqs


def test_a_failing_replay_turns_graphs_off_and_requests_still_finish_right(tensor_driven_kernels):
    model = tiny_llama()
    prompts, params = requests()
    expected = [o.token_ids for o in LLM(model, enforce_eager=True, num_blocks=64, block_size=4).generate(prompts, params)]
    llm = graph_llm(model, num_blocks=64, block_size=4)
    graphs = llm.engine.runner.graphs
    real_capture = graphs._capture

    def capture_failing_later(bs):
        graph, logits = real_capture(bs)
        replay = graph.replay

        def flaky():
            if graphs.num_replays >= 6:
                raise RuntimeError("replay failed")
            replay()

        return _Replay(flaky), logits

    graphs._capture = capture_failing_later
    with pytest.warns(RuntimeWarning, match="CUDA graphs are off"):
        outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.runner.graphs is None and llm.stats()["blocks_used"] == 0


def penalized_requests():
    """Requests whose sampling reads the tokens so far: penalties, a logit bias and min_tokens before a stop token
    that the bias makes certain (so each of those requests ends exactly after min_tokens)."""
    prompts, _ = requests()
    stop = 7
    params = [SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5),
              SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.6),
              SamplingParams(max_tokens=40, ignore_eos=True, min_tokens=12, stop_token_ids=[stop],
                             logit_bias={stop: 100.0}),
              SamplingParams(max_tokens=28, ignore_eos=True, frequency_penalty=1.5, logit_bias={3: 2.0, 11: -2.0}),
              SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=-0.5, repetition_penalty=0.8,
                             min_tokens=9, stop_token_ids=[stop], logit_bias={stop: 100.0})]
    return prompts, params, stop


def test_penalties_in_graph_steps_queued_ahead_match_eager(tensor_driven_kernels):
    """A step queued ahead samples before the host has read the previous step's tokens: its penalty counts
    and min_tokens must come from the device-side tokens, as the eager engine's do from the host."""
    model = tiny_llama()
    prompts, params, stop = penalized_requests()
    eager = LLM(model, enforce_eager=True, max_num_seqs=4, num_blocks=64, block_size=4).generate(prompts, params)
    llm = graph_llm(model, num_blocks=64, block_size=4)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager]
    for i, n in ((2, 12), (5, 9)):  # the stop token comes right after min_tokens
        assert outputs[i].outputs[0].token_ids[n:] == [stop] and stop not in outputs[i].outputs[0].token_ids[:n]
    assert llm.engine.runner.graphs.num_replays > 20 and llm.stats()["steps_queued_ahead"] > 10
