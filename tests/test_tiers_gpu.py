"""On a CUDA device: the host tier in pinned memory, copies on a side stream, and greedy outputs that are the
same whether a prefix came from the device pool, the host tier, the disk tier after a restart, or a recompute."""

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


@pytest.mark.parametrize("kv_format", ["off", "q8", "turboquant"])
def test_greedy_output_is_the_same_from_every_tier_on_cuda(tmp_path, kv_format):
    model = small_llama()
    g = torch.Generator().manual_seed(1)
    prompt, other = (torch.randint(0, 1024, (133,), generator=g).tolist() for _ in range(2))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    options = dict(kv_format=kv_format, num_blocks=10, max_num_batched_tokens=128)
    llm = LLM(model, cpu_cache_gb=0.05, kv_cache_dir=str(tmp_path), **options)
    recomputed = llm.generate(prompt, params)[0].token_ids
    prefix = llm.engine.prefix
    assert prefix.stream is not None and prefix.host.data.is_pinned()
    from_device = llm.generate(prompt, params)[0].token_ids
    llm.generate(other, params)
    from_host = llm.generate(prompt, params)[0].token_ids
    stats = llm.stats()
    assert stats["tier_host_hits"] >= 7 and stats["tier_gpu_hits"] >= 8
    prefix.close()
    assert llm.stats()["blocks_used"] == 0  # offloads in flight held their blocks until their copies were done
    restarted = LLM(model, kv_cache_dir=str(tmp_path), **options)
    from_disk = restarted.generate(prompt, params)[0].token_ids
    assert restarted.stats()["tier_disk_hits"] == 8
    assert from_device == recomputed and from_host == recomputed and from_disk == recomputed
