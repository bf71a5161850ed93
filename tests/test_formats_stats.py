"""What `paged_stats()` says about quantized pages."""

import pytest
import torch

from pagedkv import PagedKVCache

HEAD_DIM, HEADS = 128, 2


def write_and_attend(cache: PagedKVCache, num_layers: int, num_tokens: int) -> None:
    """One step of `num_tokens` new tokens of a new sequence through every layer."""
    s = cache.add_sequence()
    cache.begin_step([s], [num_tokens])
    for layer in range(num_layers):
        cache.write(layer, torch.randn(num_tokens, HEADS, HEAD_DIM), torch.randn(num_tokens, HEADS, HEAD_DIM))
        cache.attention(layer, torch.randn(num_tokens, 4, HEAD_DIM), scale=HEAD_DIM ** -0.5)


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
@pytest.mark.parametrize("spec, per_head, mode", [
    ("turboquant", 200, "turboquant:k=q8_0,v=q3_0"),
    ("turboquant:k=q4_0,v=q4_0,rotate_keys", 152, "turboquant:k=q4_0,v=q4_0,rotate_keys"),
    ("q8", 264, "q8"), ("q6", 200, "q6"), ("q4", 136, "q4"),
])
def test_paged_stats_report_the_mode_and_bytes_per_token(spec, per_head, mode):
    cache = PagedKVCache(kv_format=spec, block_size=4, num_blocks=8, num_layers=2, kernels="reference")
    write_and_attend(cache, num_layers=2, num_tokens=3)
    stats = cache.paged_stats()
    assert stats["mode"] == mode
    assert stats["bytes_per_token_per_head"] == per_head
    assert stats["bytes_per_token"] == per_head * HEADS * 2
    calls = "turboquant_attention_calls" if spec.startswith("turboquant") else "kv_quant_attention_calls"
    assert stats[calls] == stats["paged_attention_calls"] == 2


@pytest.mark.filterwarnings("ignore::pagedkv.ops.PagedKVFallbackWarning")
def test_boundary_layers_are_dense_and_bytes_are_reported_per_layer():
    cache = PagedKVCache(kv_format="turboquant", boundary_layers=1, num_layers=3, block_size=4, num_blocks=8,
                         kernels="reference")
    write_and_attend(cache, num_layers=3, num_tokens=2)
    stats = cache.paged_stats()
    assert [f.spec.kind for f in cache.formats] == ["dense", "turboquant", "dense"]
    assert stats["bytes_per_token_per_head"] == [1024, 200, 1024]  # float32 dense layers
    assert stats["bytes_per_token"] == (1024 + 200 + 1024) * HEADS
    assert stats["turboquant_attention_calls"] == 1 and stats["paged_attention_calls"] == 3
