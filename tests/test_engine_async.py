"""Asynchronous scheduling (`EngineConfig.async_scheduling`): each step is planned and queued before the host reads
the tokens of the step in flight, their input rows filled on the device. On the CPU nothing overlaps, but the path
is the same: every request's tokens must be the ones of steps run in turn."""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.model_runner import PLACEHOLDER
from test_engine_cuda_graph import graph_llm, requests, tiny_llama
from test_engine_cuda_graph import tensor_driven_kernels  # noqa: F401  (a fixture)


def run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def workload():
    prompts, params = requests()
    prompts = prompts + [prompts[3][:20] + [7, 8, 9], prompts[1] * 3]   # a shared prefix, a longer prompt
    params = params + [SamplingParams(max_tokens=11, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)]
    return prompts, params


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16, num_blocks=64, block_size=4),               # prompts in chunks, mixed steps
    dict(max_num_batched_tokens=64, num_blocks=14, block_size=4, max_num_seqs=8),   # preemption by recompute
    dict(max_num_batched_tokens=24, dynamic=True, block_size=4, kv_format="q8"),
])
def test_async_steps_give_the_tokens_of_steps_in_turn(options):
    """The same tokens, and the same tokens computed: a request whose next token ends it (max_tokens) sits out the
    step queued behind it."""
    model = tiny_llama()
    fed = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    prompts, params = workload()
    want = run(LLM(model, async_scheduling=False, **options), prompts, params)
    computed, fed[:] = sum(fed), []
    llm = LLM(model, async_scheduling=True, **options)
    assert run(llm, prompts, params) == want
    assert llm.engine.num_steps_ahead > 5   # steps were planned before the tokens before them were read
    assert sum(fed) == computed


def test_async_steps_behind_cuda_graph_decode_steps(tensor_driven_kernels):  # noqa: F811
    """Decode steps replayed from (stand-in) CUDA graphs, mixed steps queued behind them and graph steps behind
    eager ones: the tokens fed from the device are the right ones."""
    model = tiny_llama()
    prompts, params = workload()
    want = run(LLM(model, async_scheduling=False, max_num_batched_tokens=16, num_blocks=64, block_size=4,
                   max_num_seqs=4), prompts, params)
    llm = graph_llm(model, (1, 2, 4), async_scheduling=True, max_num_batched_tokens=16, num_blocks=64, block_size=4)
    assert run(llm, prompts, params) == want
    assert llm.engine.runner.graphs.num_replays > 10 and llm.engine.num_steps_ahead > 10


def test_a_stop_token_ends_a_request_whose_next_step_was_queued():
    """A request that stops on a token its queued next step already fed: that step's token is dropped, the output
    ends at the stop, and no placeholder is ever seen in a streamed output."""
    model = tiny_llama()
    prompts, _ = workload()
    plain = run(LLM(model, async_scheduling=False), prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    stops = [out[4] for out in plain]   # each request's fifth token stops it (or an earlier copy of it)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[t]) for t in stops]
    want = run(LLM(model, async_scheduling=False, max_num_batched_tokens=16), prompts, params)
    assert all(len(w) <= 5 for w in want)
    llm = LLM(model, async_scheduling=True, max_num_batched_tokens=16)
    engine = llm.engine
    ids = [engine.add_request(p, q, stream=True) for p, q in zip(prompts, params)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert PLACEHOLDER not in out.outputs[0].token_ids
            final[out.request_id] = out.outputs[0].token_ids
    assert [final[i] for i in ids] == want
    assert llm.stats()["requests_running"] == 0


def test_requests_that_need_their_tokens_on_the_host_run_in_turn():
    """Penalties, log-probabilities and n > 1 read the host's tokens: their steps are not queued ahead, and give
    what they give without asynchronous scheduling."""
    model = tiny_llama()
    prompts, _ = workload()
    for params in (SamplingParams(max_tokens=6, repetition_penalty=1.3),
                   SamplingParams(max_tokens=6, logprobs=2),
                   SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3)):
        want = LLM(model, async_scheduling=False).generate(prompts[:3], params)
        llm = LLM(model, async_scheduling=True)
        got = llm.generate(prompts[:3], params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
        assert llm.engine.num_steps_ahead == 0


def test_async_scheduling_is_on_for_cuda_only_by_default():
    from pagedkv.engine.config import EngineConfig
    from pagedkv.errors import ConfigError

    assert EngineConfig().schedules_async(torch.device("cuda")) and not EngineConfig().schedules_async(torch.device("cpu"))
    assert EngineConfig(async_scheduling=True).schedules_async(torch.device("cpu"))
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the default there: CUDA graphs, Triton kernels)")
@pytest.mark.parametrize("kv_format", ["off", "q4", "turboquant"])
def test_async_scheduling_on_the_gpu_gives_the_tokens_of_steps_in_turn(kv_format):
    """On CUDA, with CUDA graph decode steps and the Triton kernels (head_dim 64): the same schedule, so the same
    tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    prompts, params = workload()
    options = dict(kv_format=kv_format, max_num_batched_tokens=32, num_blocks=96, block_size=16, max_num_seqs=8,
                   cuda_graph_batch_sizes=(1, 2, 4, 8))
    want = run(LLM(model, async_scheduling=False, **options), prompts, params)
    llm = LLM(model, async_scheduling=True, **options)
    assert run(llm, prompts, params) == want
    assert llm.engine.num_steps_ahead > 5 and llm.stats()["cuda_graph_replays"] > 5


def test_the_runner_fills_only_the_rows_it_is_given():
    """A queued step whose rows come from the host alone (its in-flight tokens' sequences sat it out) feeds the host's
    ids as they are; the others get theirs from the device tokens."""
    llm = LLM(tiny_llama(), async_scheduling=True)
    runner = llm.engine.runner
    tokens = torch.tensor([40, 41, 42])
    assert runner._filled_ids([5, 6, 7], [], tokens).tolist() == [5, 6, 7]
    assert runner._filled_ids([5, PLACEHOLDER, 7, PLACEHOLDER], [(1, 2), (3, 0)], tokens).tolist() == [5, 42, 7, 40]
