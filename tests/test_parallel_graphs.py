"""Tensor-parallel decode steps replayed from CUDA graphs on every rank, on the CPU.

The graphs are the CPU stand-in of tests/test_engine_cuda_graph.py (a "replay" re-runs the forward over
the runner's static buffers, and attention/writes read only the metadata tensors, as the Triton kernels
do). Rank 0's engine captures and replays; the followers capture and replay with it, fed the step's
inputs by the broadcast of the static buffers (with a dense recent window, its ring slots, rows and first
blocks too). 1 and 2 gloo ranks must give one process's tokens for every page format, with the pool growing
(a re-capture on every rank) and more requests than buckets.
"""

import gc

import pytest
import torch

import pagedkv.ops
import pagedkv.ops.triton
from pagedkv import LLM, SamplingParams
from pagedkv.parallel import follow, install_sharded_cache, launch, lead, load_sharded_model
from test_engine_cuda_graph import EagerReplayRunner, _tensor_driven_attention, _tensor_driven_write
from test_parallel import FORMATS as ALL_FORMATS
from test_parallel import _save_tiny_llama

# A dense recent window over pages the decode kernel reads (KV-Quant): its ring buffers travel with the
# static buffers (test_parallel's window format, TurboQuant at head_dim 16, decodes eagerly: not here).
FORMATS = [f for f in ALL_FORMATS if "recent_tokens" not in f] + ["q4:recent_tokens=8"]

PROMPTS = [[7, 12, 99, 3, 45, 200, 17, 18, 64, 31, 5], [40, 41, 42, 43, 250], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
PARAMS = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 12, 6, 10)]
CACHE = dict(block_size=4, num_blocks=2, dynamic=True)  # the pool grows while decoding: graphs are captured again
BUCKETS = (1, 2)  # fewer rows than requests: batches move between buckets, requests wait


def use_standin_kernels():
    """Every layer "runs the Triton kernels", which here read only the metadata tensors (a rank's own process)."""
    pagedkv.ops.choose_backend = lambda device, kernels, fmt: ("triton", None)
    pagedkv.ops.triton.write_kv = _tensor_driven_write
    pagedkv.ops.triton.paged_attention = _tensor_driven_attention


def graph_llm(model, cache):
    """An LLM on rank 0 over a sharded cache whose decode steps replay the stand-in graphs."""
    llm = LLM(model, cache=cache, cuda_graph_batch_sizes=BUCKETS, max_num_seqs=max(BUCKETS))
    runner = llm.engine.runner
    runner.graphs = EagerReplayRunner(model, cache, runner.cache_kwarg, BUCKETS,
                                      max_blocks_per_seq=cache.blocks_for(llm.engine.max_model_len))
    return llm


def _graph_work(group, folder):
    use_standin_kernels()
    model, _ = load_sharded_model(folder, group)
    if not group.is_leader:
        caches = follow(model, group, graph_runner=EagerReplayRunner)
        return {"caches_left": len(caches)}
    out = {}
    with lead(model, group):
        for fmt in FORMATS:
            llm = graph_llm(model, install_sharded_cache(model, kv_format=fmt, **CACHE))
            tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
            graphs = llm.engine.runner.graphs
            out[fmt] = {"tokens": tokens, "replays": graphs.num_replays, "captures": graphs.num_captures,
                        "queued_ahead": llm.stats()["steps_queued_ahead"], "blocks_used": llm.stats()["blocks_used"]}
            del llm, graphs
        gc.collect()  # the engines are gone: the release tells the followers to drop their caches and runners
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(_save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def one_process(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with pytest.MonkeyPatch.context() as patch:  # the kernels the ranks run, eagerly
        patch.setattr(pagedkv.ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
        patch.setattr(pagedkv.ops.triton, "write_kv", _tensor_driven_write)
        patch.setattr(pagedkv.ops.triton, "paged_attention", _tensor_driven_attention)
        return {fmt: [o.token_ids for o in LLM(model, enforce_eager=True, kv_format=fmt, **CACHE)
                      .generate(PROMPTS, PARAMS)] for fmt in FORMATS}


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def ranks(request, tiny_llama):
    return launch(_graph_work, request.param, "cpu", tiny_llama)


@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_decode_on_every_rank_equals_one_process(ranks, one_process, fmt):
    run = ranks[0][fmt]
    assert run["tokens"] == one_process[fmt]
    assert run["replays"] > 10 and run["queued_ahead"] > 5  # the decode steps went through the graphs
    assert run["captures"] > 1  # the pool grew under the graphs: every rank captured again
    assert run["blocks_used"] == 0


def test_followers_drop_the_caches_the_leader_dropped(ranks):
    assert [r["caches_left"] for r in ranks[1:]] == [0] * (len(ranks) - 1)
