"""The seed's API names (`pagedkv.compat.mtplx`)."""

from pathlib import Path

import pytest
import torch

from pagedkv import KVFormat, PagedKVCache
from pagedkv.compat.mtplx import VllmMetalPagedKVCache, install_vllm_metal_paged_attention_kv_cache

SEED_EXAMPLE = Path(__file__).parent / "data" / "mtplx_seed_example.txt"


def test_the_seed_cache_is_a_paged_kv_cache_with_the_seed_defaults():
    cache = VllmMetalPagedKVCache()
    assert isinstance(cache, PagedKVCache)
    assert (cache.block_size, cache.num_blocks) == (16, 1024)
    assert cache.key_cache is None and cache.value_cache is None  # nothing allocated before the first write
    assert cache.config.kv_format == KVFormat()


def test_the_seed_quantization_configs_choose_the_page_format():
    turbo = VllmMetalPagedKVCache(turboquant_config={"k_quant": "q8_0", "v_quant": "q3_0"},
                                  kv_quant_config={"dtype": "bf16"})
    assert turbo.config.kv_format == KVFormat(kind="turboquant", k_quant="q8_0", v_quant="q3_0")
    kvq = VllmMetalPagedKVCache(kv_quant_config={"mode": "q4", "dtype": "fp16"}, block_size=8)
    assert kvq.config.kv_format == KVFormat(kind="kvquant", mode="q4", dtype=torch.float16)
    assert kvq.block_size == 8


def test_the_seed_environment_variables_are_read_as_aliases(monkeypatch):
    monkeypatch.setenv("MTPLX_DYNAMIC_PAGED_KV", "1")
    monkeypatch.setenv("MTPLX_CONTEXT_WINDOW_TOKENS", "4096")
    cache = VllmMetalPagedKVCache()
    assert cache.config.dynamic is True and cache.config.context_window_tokens == 4096


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_the_seed_example_runs_with_only_its_import_line_changed(smollm2, capsys):
    source = SEED_EXAMPLE.read_text()
    assert source.startswith("from mtplx.cache_state import VllmMetalPagedKVCache\n")
    source = source.replace("from mtplx.cache_state import", "from pagedkv.compat.mtplx import", 1)

    model, tokenizer = smollm2
    install_vllm_metal_paged_attention_kv_cache(model)
    batch = tokenizer(["It is a truth universally acknowledged, that a single man"], return_tensors="pt")
    namespace = {"model": model, "input_ids": batch.input_ids, "mask": batch.attention_mask}
    with torch.inference_mode():
        exec(compile(source, str(SEED_EXAMPLE), "exec"), namespace)

    cache = namespace["paged_cache"]
    num_layers = model.config.num_hidden_layers
    stats = cache.paged_stats()
    assert stats["mode"] == "turboquant:k=q8_0,v=q3_0"
    assert stats["allocated_blocks"] == 1024 and stats["used_blocks"] == 1
    assert stats["paged_attention_calls"] == stats["turboquant_attention_calls"] == num_layers
    assert capsys.readouterr().out == f"Allocated blocks: 1024\nPaged attention calls: {num_layers}\n"
    # the quantized cache predicts the same next token as dense pages
    with torch.inference_mode():
        dense = model(batch.input_ids, attention_mask=batch.attention_mask, cache=PagedKVCache(num_layers=num_layers))
    assert torch.equal(namespace["outputs"].logits[0, -1].argmax(), dense.logits[0, -1].argmax())
