"""A server must not compile kernels mid-stream: Triton keys its compile cache on every integer argument's value
class (== 1, a multiple of 16) and every pointer's 16-byte alignment, unless told not to, so an argument whose class
changes from step to step compiles each kernel it reaches again (seconds on a GPU, inside a request's latency).
Continuous batching over every path of the kernels, under the interpreter, with each launch's compile key
recorded: past the constexprs (tile configs, formats), every argument keeps one class."""

import collections
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.ops import triton as triton_ops
from pagedkv.ops.triton import tuning
from triton_cases import build_case, launch_keys

# The launches are recorded where the interpreter runs them: on the CPU, as in CI. On a GPU the kernels compile instead.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="records the Triton interpreter's launches; runs on the CPU (CI)")


def test_continuous_batching_keeps_each_kernel_arguments_class(monkeypatch):
    """24 requests of 3-80 prompt tokens, 7 at a time, 64 tokens a step, over q8 pages with a dense recent window
    (the most paths: the write, decode, dequantize and prefill kernels, the ring read by the last three): prefills,
    chunks, mixed steps of any number of decodes."""
    from pagedkv.engine import LLM, SamplingParams

    keys = launch_keys(monkeypatch)
    monkeypatch.setattr(triton_ops, "supports", lambda device, fmt: (True, None))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    llm = LLM(LlamaForCausalLM(config).eval(), kv_format="q8:recent_tokens=16", num_blocks=96, block_size=16,
              max_num_seqs=7, max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 80, (24,), generator=g).tolist()
    lengths[5:5] = [7, 250, 266]   # block tables 1 block wide, then 16 and 17 (with the new tokens)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert {"write_kv_kernel", "paged_attention_kernel", "decode_kernel_transposed", "dequantize_kernel"} <= keys.keys()
    for kernel, launches in keys.items():
        classes = collections.defaultdict(set)
        for key in launches:
            for arg, spec in key:
                if isinstance(spec, tuple):   # not a constexpr: (type, value class)
                    classes[arg].add(spec[1])
        assert {arg: c for arg, c in classes.items() if len(c) > 1} == {}, kernel


@pytest.mark.parametrize("spec", ["q4", "turboquant"])
def test_mixed_steps_compile_no_kernel_again_whatever_their_decodes(monkeypatch, spec):
    """Steps of continuous batching that differ only in how many decodes come before the same chunks (1 to 5) launch
    every kernel with a compile key the first step used: no kernel compiles again mid-stream. (The chunks' part
    used to be a slice from row `decodes`: misaligned but for multiples of four, a compile of each chunk kernel,
    0.3-0.6 s on an H200, at the first such step.)"""
    keys = launch_keys(monkeypatch)
    monkeypatch.setattr(tuning, "DENSE_PREFILL", True)
    seen = []
    for k in range(1, 6):
        case = build_case(k, spec, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                          ctx_lens=[40] * k + [37, 0], new_lens=[1] * k + [70, 64])
        triton_ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
        seen.append({name: set(launches) for name, launches in keys.items()})
    assert "dequantize_kernel" in seen[0] and len(seen[0]) >= 2
    assert seen[-1] == seen[0]
