"""`compile_layers` (`pagedkv.hf.compile_layers`, `EngineConfig.compile_layers`): each decoder layer compiled with
torch.compile, the paged cache's writes and attention called from the graphs as opaque functions. On the CPU with
inductor (a C++ compiler): the engine generates the tokens it generates eagerly, the layers share their graphs, and
new prompt lengths and batch sizes compile nothing new."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv import LLM
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import ConfigError


def tiny_llama(layers: int = 3):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def requests(seed: int, lengths):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    return prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("kv_format", ["off", "q4"])
def test_compiled_layers_generate_the_eager_tokens_and_share_their_graphs(kv_format):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()   # the compiled code of the test before (the same layer classes) and its counts
    counters.clear()
    options = dict(kv_format=kv_format, block_size=16, max_num_batched_tokens=64)
    eager = LLM(tiny_llama(), **options)
    compiled = LLM(tiny_llama(), compile_layers=True, **options)
    prompts, params = requests(0, (5, 17, 3, 33))
    assert tokens(compiled.generate(prompts, params)) == tokens(eager.generate(prompts, params))
    # three layers, one set of graphs: a layer's index is not specialized on (each of the layer's five pieces
    # between the cache's calls compiled at most twice, static for the first shape and then with the token count
    # dynamic, `COMPILE_OPTIONS`' automatic dynamic shapes; a graph per layer would make 15 or more)
    assert 0 < counters["stats"]["unique_graphs"] <= 10, dict(counters["stats"])
    # steps of one token (one sequence decoding alone) get their own graphs once: torch.compile specializes a
    # dimension of size 1
    prompts, params = requests(2, (9,))
    assert tokens(compiled.generate(prompts, params)) == tokens(eager.generate(prompts, params))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 16, dict(counters["stats"])
    # other prompt lengths, chunk sizes and batch sizes: the dynamic graphs serve them
    prompts, params = requests(1, (7, 40, 11, 2, 25))
    assert tokens(compiled.generate(prompts, params)) == tokens(eager.generate(prompts, params))
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


def test_compile_options_reach_every_layer_and_arguments_override_them(monkeypatch):
    import pagedkv.hf
    from pagedkv.hf import compile_layers

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: seen.append(options))
    monkeypatch.setitem(pagedkv.hf.COMPILE_OPTIONS, "dynamic", None)
    assert compile_layers(tiny_llama(layers=2)) == 2
    assert seen == [{"dynamic": None}] * 2
    seen.clear()
    compile_layers(tiny_llama(layers=2), dynamic=True, mode="max-autotune-no-cudagraphs")
    assert seen == [{"dynamic": True, "mode": "max-autotune-no-cudagraphs"}] * 2


def test_a_model_without_decoder_layers_is_refused():
    from pagedkv.hf import compile_layers

    with pytest.raises(ConfigError, match="no decoder layers"):
        compile_layers(torch.nn.Linear(4, 4))


def test_compiled_by_default_only_where_cuda_graphs_replay():
    from pagedkv.engine.config import EngineConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not EngineConfig().compiles_layers(cpu)
    assert EngineConfig().compiles_layers(cuda)
    assert not EngineConfig(enforce_eager=True).compiles_layers(cuda)   # host-bound steps: guards would cost
    assert not EngineConfig().compiles_layers(cuda, tensor_parallel=True)   # not tried with sharded layers
    assert EngineConfig(compile_layers=True).compiles_layers(cuda, tensor_parallel=True)
    assert EngineConfig(compile_layers=True).compiles_layers(cpu)
    assert EngineConfig(compile_layers=True, enforce_eager=True).compiles_layers(cuda)
    assert not EngineConfig(compile_layers=False).compiles_layers(cuda)
    with pytest.raises(ConfigError, match="compile_layers='yes'"):
        EngineConfig(compile_layers="yes")


def test_an_eager_engine_on_the_cpu_compiles_nothing():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    llm = LLM(tiny_llama(layers=1), kv_format="off", block_size=16)
    llm.generate(*requests(3, (5,)))
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])


def test_serve_takes_compile_layers_on_off_or_default():
    from pagedkv.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).compile_layers is None
    assert parse(["serve", "--compile-layers"]).compile_layers is True
    assert parse(["serve", "--no-compile-layers"]).compile_layers is False
