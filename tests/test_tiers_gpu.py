"""On a CUDA device: the host tier in pinned memory, copies on a side stream, and greedy outputs that are the
same whether a prefix came from the device pool, the host tier, the disk tier after a restart, or a recompute."""

import pytest
import torch

from pagedkv import LLM, PagedKVCache, SamplingParams
from pagedkv.tiers import TieredPrefixCache, TierSettings

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
    assert prefix.load_stream is not None and prefix.offload_stream is not None and prefix.host.data.is_pinned()
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


def test_a_load_right_after_an_offload_reads_what_the_offload_wrote():
    """The load stream waits for the offload stream's copies into the host slots it reads, and a release frees
    its device blocks at once (the offload gathers them on the compute stream)."""
    bs, num_blocks, heads, head_dim = 16, 1100, 8, 128
    identity = {"architecture": "TestForCausalLM", "num_layers": 4, "num_kv_heads": heads, "head_dim": head_dim,
                "weights": "c" * 64}
    cache = PagedKVCache(num_blocks=num_blocks, block_size=bs, kv_format="off", num_layers=4, model_identity=identity,
                         device="cuda")
    cache.init_layers(4, heads, head_dim, torch.bfloat16, "cuda")
    prefix = TieredPrefixCache(cache, TierSettings(cpu_cache_gb=1.0))
    tokens = list(range(1024 * bs + 3))  # 1024 full blocks: 128 MiB, a few ms of copies each way
    hashes = prefix.block_hashes([], tokens)
    seq = cache.add_sequence()
    cache.begin_step([seq], [len(tokens)])
    for layer in range(4):
        cache.write(layer, torch.randn(len(tokens), heads, head_dim, device="cuda", dtype=torch.bfloat16),
                    torch.randn(len(tokens), heads, head_dim, device="cuda", dtype=torch.bfloat16))
    cache.end_forward()
    prefix.register(seq, hashes, 0, len(tokens))
    ids = cache.block_table(seq)[:1024]
    original = [{k: v[ids].clone() for k, v in pages.items()} for pages in cache.pages]
    prefix.release(seq)
    assert cache.pool.num_used == 0 and prefix._writing  # free at once; the copy to the host is tracked
    for pages in cache.pages:  # the next request overwrites the freed blocks on the compute stream
        for page in pages.values():
            page.fill_(7)
    cache.pool.decref(cache.pool.allocate(cache.pool.num_free))  # and they lose their hashes
    loaded = prefix.match(hashes, 1024, free_blocks=cache.pool.num_free)
    assert len(loaded) == 1024 and prefix.loaded_blocks["host"] == 1024
    for pages, want in zip(cache.pages, original):
        for name, page in pages.items():
            assert torch.equal(page[loaded].view(torch.uint8), want[name].view(torch.uint8)), name
    prefix.close()
    stats = prefix.as_dict()
    assert stats["tier_load_gbps"] > 1 and stats["tier_offload_gbps"] > 1
