"""The decode runner's static buffers, buckets and padding, on the CPU.

A captured graph replays its kernels over whatever the static buffers hold at replay time. Here a
stand-in "graph" re-runs the forward over the same static buffers, and attention/writes read only
the metadata tensors (never the host-side lists), as the Triton kernels do. Batches that shrink and
grow across buckets, sequences that gain blocks mid-decode and a pool that reallocates its pages
must give exactly the eager engine's tokens. (The real capture runs in tests/test_engine_gpu.py.)
"""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import pagedkv.ops
import pagedkv.ops.triton
from pagedkv import LLM, SamplingParams
from pagedkv.engine.cuda_graph import CUDAGraphRunner, MixedGraphRunner
from pagedkv.ops import reference


def _tensor_driven_write(pages, fmt, key, value, meta):
    keep = (meta.slot_mapping >= 0).nonzero().flatten()  # padding rows have slot -1
    reference.write_kv(pages, fmt, key, value, dataclasses.replace(meta, token_index=keep))


def _tensor_driven_attention(query, pages, fmt, meta, window=None, **kwargs):
    if meta.parts is not None:  # a mixed step: decode rows, then the chunks' rows (padding after them stays zero)
        decodes, chunks = meta.parts
        n, m = decodes.block_table.shape[0], int(chunks.query_start_loc[-1])
        out = torch.zeros_like(query)
        out[:n] = _tensor_driven_attention(query[:n], pages, fmt, decodes, **kwargs)
        out[n:n + m] = _tensor_driven_attention(query[n:n + m], pages, fmt, chunks, **kwargs)
        return out
    exact = dataclasses.replace(meta, seq_lens_cpu=meta.seq_lens.tolist(),
                                query_start_loc_cpu=meta.query_start_loc.tolist())
    if window is not None:  # the dense recent window: ring rows and first blocks from the plan's tensors too
        plan = meta.window
        exact.window = dataclasses.replace(plan, rows_cpu=plan.rows.tolist(), first_block_cpu=plan.first_block.tolist())
        kwargs["sequence_kv"] = pagedkv.ops._window_reader(window, None, pages, fmt, exact)
    return reference.paged_attention(query, pages, fmt, exact, **kwargs)


class _Replay:
    def __init__(self, fn):
        self.replay = fn


class EagerReplay:
    """Captures nothing: replay runs the forward again over the static buffers, which must be the tensors
    the graphs were captured over (pages and rings neither reallocated nor grown by the replay)."""

    def _capture(self, bs):
        logits = self._forward(bs).clone()

        def replay():
            assert self._current_pages_key() == self._pages_key, "replaying over tensors the graphs do not hold"
            self.cache.plan = self._metadata(bs)
            try:
                logits.copy_(self._forward(bs))
            finally:
                self.cache.end_forward()
            assert self._current_pages_key() == self._pages_key, "a replay cannot reallocate tensors"

        return _Replay(replay), logits


class EagerReplayRunner(EagerReplay, CUDAGraphRunner):
    pass


class EagerReplayMixedRunner(EagerReplay, MixedGraphRunner):
    pass


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
    the largest bucket unless given. With cuda_graph_mixed_tokens, mixed steps go through the mixed runner."""
    options.setdefault("max_num_seqs", max(batch_sizes))
    llm = LLM(model, cuda_graph_batch_sizes=batch_sizes, **options)
    runner, cache = llm.engine.runner, llm.engine.cache
    max_blocks = cache.blocks_for(llm.engine.max_model_len)
    runner.graphs = EagerReplayRunner(model, cache, runner.cache_kwarg, batch_sizes, max_blocks_per_seq=max_blocks)
    if options.get("cuda_graph_mixed_tokens"):
        runner.mixed_graphs = EagerReplayMixedRunner(model, cache, runner.cache_kwarg, batch_sizes,
                                                     max_blocks_per_seq=max_blocks,
                                                     step_tokens=options["cuda_graph_mixed_tokens"])
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


# ----------------------------------------------------------------------------------------------------------
# a dense recent window (`recent_tokens`): captured steps write the rings and read them, driven by tensors

WINDOW = dict(block_size=16, num_blocks=64)


def window_requests():
    """Eight requests that cross block boundaries and outgrow a window of 32 tokens (blocks leave the rings)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 30, 3, 47, 12, 20, 9, 16)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (60, 40, 70, 24, 50, 36, 44, 30)]
    return prompts, params


def generate_in_waves(llm, prompts, params, first_steps=6):
    """The first request alone for a few steps, then the others: they take ring rows mid-run."""
    engine, done = llm.engine, {}

    def step():
        done.update({o.request_id: o for o in engine.step() if o.finished})

    ids = [engine.add_request(prompts[0], params[0])]
    for _ in range(first_steps):
        step()
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    while engine.has_unfinished():
        step()
    return [done[i].token_ids for i in ids]


@pytest.mark.parametrize("kv_format", ["q4:recent_tokens=32", "q8:recent_tokens=32"])
def test_graph_decode_with_a_dense_window_matches_eager(tensor_driven_kernels, kv_format):
    """Buckets of 1, 2 and 4 under up to 8 running requests (larger batches decode eagerly, over the same rings);
    the rings start with room for 4 sequences and grow when the second wave arrives: captured again."""
    model = tiny_llama()
    prompts, params = window_requests()
    expected = generate_in_waves(LLM(model, enforce_eager=True, max_num_seqs=8, kv_format=kv_format, **WINDOW),
                                 prompts, params)
    if kv_format.startswith("q4"):  # the window changes these tokens: a step that missed the rings would show
        plain = LLM(model, enforce_eager=True, max_num_seqs=8, kv_format="q4", **WINDOW)
        assert generate_in_waves(plain, prompts, params) != expected
    llm = graph_llm(model, max_num_seqs=8, kv_format=kv_format, **WINDOW)
    assert generate_in_waves(llm, prompts, params) == expected
    graphs, window = llm.engine.runner.graphs, llm.engine.cache.window
    assert graphs.num_replays > 25
    # the pool never grows (64 blocks): every capture after the first followed the rings' growth
    assert llm.engine.cache.grow_events == 0 and graphs.num_captures > 1 and window.scratch_row >= 8
    assert llm.stats()["blocks_used"] == 0 and not window.rings


def test_full_pool_with_a_dense_window_preempts_and_recovers(tensor_driven_kernels):
    """Preempted requests give their ring rows back and take one again when they come back."""
    model = tiny_llama()
    prompts, params = window_requests()
    options = dict(kv_format="q4:recent_tokens=32", block_size=16)
    expected = [o.token_ids for o in LLM(model, enforce_eager=True, num_blocks=64, **options).generate(prompts, params)]
    llm = graph_llm(model, num_blocks=10, admission_lookahead_tokens=0, **options)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["preemptions"] > 0 and llm.engine.runner.graphs.num_replays > 30
    assert stats["blocks_used"] == 0 and not llm.engine.cache.window.rings


@pytest.mark.parametrize("k", [1, 3])
def test_verify_steps_with_a_dense_window_replay_the_verify_graph_runner(tensor_driven_kernels, k):
    """Verify steps (k drafted tokens) read the window in the decode kernel, so they replay a graph runner too;
    the eager engine with the same fixed-length drafts gives the tokens (a verify step reads the window of its
    last token, so not those of plain decoding)."""
    model = tiny_llama()
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, [3, 1, 4, 1, 5, 9, 2, 6] * 2]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    options = dict(kv_format="q4:recent_tokens=32", speculative=f"ngram:k={k},adaptive=0", **WINDOW)
    eager = LLM(model, enforce_eager=True, max_num_seqs=4, **options)
    eager.engine.speculator.fixed_k = True
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = graph_llm(model, **options)
    engine = llm.engine
    engine.runner.verify_graphs = verify = EagerReplayRunner(
        model, engine.cache, engine.runner.cache_kwarg, (1, 2, 4),
        max_blocks_per_seq=engine.cache.blocks_for(engine.max_model_len), query_len=k + 1)
    engine.speculator.fixed_k = True
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert verify.num_replays > 10 and llm.stats()["spec_accepted_tokens"] > 0
    assert llm.stats()["blocks_used"] == 0


def test_sequences_taking_ring_rows_in_graph_steps_are_captured_again(tensor_driven_kernels):
    """Sequences that start from another's cached blocks take their ring rows in the graph step itself: past
    the rings' capacity, the runner grows them and captures again before the replay (the stand-in replay
    asserts it runs over the captured rings). Eight such sequences, four a step, give the logits of one
    decoded eagerly (its new token read exact from its ring)."""
    model = tiny_llama()
    engine = graph_llm(model, kv_format="q4:recent_tokens=32", **WINDOW).engine
    cache, graphs, kwarg = engine.cache, engine.runner.graphs, engine.runner.cache_kwarg
    prompt = window_requests()[0][3][:33]

    def forward(seq_ids, tokens, start):  # an eager step: tokens [num_seqs, n] from position start
        cache.begin_step(seq_ids, [len(t) for t in tokens])
        try:
            ids = torch.tensor([[t for row in tokens for t in row]])
            positions = torch.tensor([[start + i for row in tokens for i in range(len(row))]])
            return model(input_ids=ids, position_ids=positions, use_cache=True, **{kwarg: cache}).logits[0]
        finally:
            cache.end_forward()

    def shared():  # a new sequence holding the first 32 tokens' blocks, without a ring
        blocks = cache.block_table(first)[:2]
        cache.pool.incref(blocks)
        return cache.add_sequence(prefix_block_ids=blocks)

    with torch.inference_mode():
        first = cache.add_sequence()
        forward([first], [prompt[:32]], 0)
        expected = forward([shared()], [prompt[32:]], 32)[-1]
        steps = [[SimpleNamespace(seq_id=shared(), token_ids=prompt[:33]) for _ in range(4)] for _ in range(2)]
        logits = [graphs.run(seqs).clone() for seqs in steps]
    assert graphs.num_captures == 2 and cache.window.num_rows == 10 and cache.window.scratch_row >= 10
    rows = torch.cat(logits)  # [8, vocab]: the same inputs before and after the capture, the same logits
    assert torch.equal(rows, rows[:1].expand_as(rows))
    # the eager step's matmuls are over one row, the bucket's over four: float32 rounding apart, no more
    torch.testing.assert_close(rows[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in_turn", "async"])
@pytest.mark.parametrize("options", [dict(num_blocks=64, block_size=4), dict(dynamic=True, block_size=4)])
def test_mixed_steps_replay_the_mixed_runner_and_match_eager(tensor_driven_kernels, options, async_scheduling):
    """A small step budget chunks prompts beside the decodes: those steps go through the mixed runner (decode rows,
    then up to two chunks padded to the bucket's chunk rows, logits of the decodes and of the chunks that finish their
    prompt), and every request gets the eager engine's tokens; steps of three chunks run eagerly."""
    model = tiny_llama()
    prompts, params = requests()
    eager = LLM(model, enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=10, **options).generate(prompts,
                                                                                                          params)
    llm = graph_llm(model, max_num_batched_tokens=10, cuda_graph_mixed_tokens=10, async_scheduling=async_scheduling,
                    **options)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    stats = llm.stats()
    assert stats["cuda_graph_mixed_replays"] >= 5, stats
    assert stats["cuda_graph_replays"] > 10 and stats["blocks_used"] == 0


def test_mixed_steps_under_preemption_with_async_scheduling_keep_their_graphs(tensor_driven_kernels):
    """A pool too small for the batch preempts requests, and async scheduling feeds decodes their in-flight token
    (PLACEHOLDER on the host): a mixed step with fewer decodes than the step before pads their rows with token 0, not
    with the placeholder left there (an out-of-range embedding index, which turned the graphs off on the CPU and
    failed a device assert on the GPU). Every request gets the eager engine's tokens."""
    model = tiny_llama()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True) for _ in range(24)]
    options = dict(num_blocks=40, block_size=4, max_num_batched_tokens=32)
    expected = [o.token_ids for o in LLM(model, enforce_eager=True, max_num_seqs=16, **options).generate(prompts, params)]
    llm = graph_llm(model, batch_sizes=(1, 2, 4, 8, 16), cuda_graph_mixed_tokens=32, async_scheduling=True, **options)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert llm.engine.runner.mixed_graphs is not None, "the graphs were turned off"
    assert stats["preemptions"] > 0 and stats["cuda_graph_mixed_replays"] > 20, stats


class _CopyEvent:
    """A stand-in CUDA event: whether the copy up recorded after it may still be queued."""

    def __init__(self):
        self.pending = False

    def record(self):
        self.pending = True

    def synchronize(self):
        self.pending = False


def test_a_host_twin_is_filled_only_after_its_last_copy_up_ran(tensor_driven_kernels):
    """The engine does not wait for a mixed step that samples nothing (chunks that do not end their prompt), so such
    steps queue up ahead of the GPU: each runner waits for the copy up of a host twin's previous contents before it
    fills the twin again (torn inputs failed a device assert on the GPU)."""
    model = tiny_llama()
    prompts, params = requests()
    llm = graph_llm(model, max_num_batched_tokens=10, cuda_graph_mixed_tokens=10, async_scheduling=True,
                    num_blocks=64, block_size=4)
    fills = []
    for runner in (llm.engine.runner.graphs, llm.engine.runner.mixed_graphs):
        runner._copied = [_CopyEvent(), _CopyEvent()]
        real = runner._fill_host

        def fill_host(host, *args, runner=runner, real=real):
            fills.append(runner._copied[runner.host.index(host)].pending)
            return real(host, *args)

        runner._fill_host = fill_host
    llm.generate(prompts, params)
    assert len(fills) > 20 and not any(fills)


def test_mixed_runner_layout():
    """The host side of one mixed step: decode rows, the bucket's padding, two chunks packed after the bucket's rows
    and padded, their query offsets, table rows and the kept rows (decodes, then the chunk that samples)."""
    from pagedkv.cache import PagedKVCache
    from pagedkv.engine.sequence import Sequence

    cache = PagedKVCache(num_blocks=32, block_size=4)
    model = tiny_llama()
    runner = MixedGraphRunner(model, cache, "cache", (1, 2, 4), max_blocks_per_seq=8, step_tokens=10)
    assert runner.chunk_rows == {1: 10, 2: 8, 4: 7}   # a step of 10 tokens past the bucket before
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    decode = Sequence("a", 0, [1, 2, 3, 4, 5, 6], params)
    first, second = Sequence("b", 1, [7] * 9, params), Sequence("c", 2, [8, 9, 10], params)
    for seq, done in ((decode, 5), (first, 4), (second, 0)):
        cache.add_sequence(seq.seq_id)
        cache.reserve([seq.seq_id], [done])
        seq.num_computed_tokens = done
    seqs, counts = [decode, first, second], [1, 5, 3]
    slots = cache.reserve([s.seq_id for s in seqs], counts)
    held = [cache.seqs[s.seq_id] for s in seqs]
    host = runner.host[0]
    runner._fill_host(host, seqs[:1], held[:1], slots[:1], 2, [[6]], None)
    rows = runner._fill_chunks(host, seqs[1:], held[1:], slots[1:], counts[1:], 1, 2, [False, True])
    assert rows == [0, 2, 7]
    ints = host.np_ints
    assert ints[0, :2 + 8].tolist() == [6, 0, 7, 7, 7, 7, 7, 8, 9, 10]
    assert ints[1, :2 + 8].tolist() == [5, 0, 4, 5, 6, 7, 8, 0, 1, 2]
    assert ints[2, 1] == -1 and ints[2, 2:7].tolist() == slots[1] and ints[2, 7:10].tolist() == slots[2]
    assert ints[2, 10:].tolist() == [-1] * (len(ints[2]) - 10)   # padding rows write nowhere
    assert host.np_seq_lens[:4].tolist() == [6, 1, 9, 3]
    assert host.np_per_seq[-1, :3].tolist() == [0, 5, 8]
    assert host.np_block_table[2, :3].tolist() == held[1].block_ids[:3]
    assert host.np_block_table[3, :1].tolist() == held[2].block_ids[:1]
    assert ints[host.keep_row, :4].tolist() == [0, 9, 6, 0]   # the decode, the sampled chunk's last row, the other


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_mixed_tokens_get_a_clear_error(bad):
    from pagedkv.engine.config import EngineConfig
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match="cuda_graph_mixed_tokens"):
        EngineConfig(cuda_graph_mixed_tokens=bad)


def test_buckets_a_mixed_step_leaves_no_chunk_rows_are_not_captured(monkeypatch):
    """A step of 4 tokens fills bucket 4 (1-4 decodes, or none) with at most 4 chunk tokens: bucket 8 (5-8 decodes)
    has no room and is not captured."""
    from pagedkv.cache import PagedKVCache

    runner = MixedGraphRunner(tiny_llama(), PagedKVCache(num_blocks=8, block_size=4), "cache", (4, 8),
                              max_blocks_per_seq=4, step_tokens=4)
    assert runner.chunk_rows == {4: 4} and runner.batch_sizes == [4]
    monkeypatch.setattr(runner, "is_capturable", lambda: True)
    assert runner.can_run_mixed(0, [4]) and runner.can_run_mixed(3, [1]) and runner.can_run_mixed(4, [2, 2])
    assert not runner.can_run_mixed(3, [3, 2])     # more chunk tokens than the bucket's rows
    assert not runner.can_run_mixed(0, [1, 1, 1])  # more chunks than MIXED_CHUNK_SEQS
    assert not runner.can_run_mixed(5, [1])        # bucket 8 is not captured
