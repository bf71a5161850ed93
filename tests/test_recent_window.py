"""The dense recent window option (`recent_tokens`): parsing and validation."""

import pytest
import torch

from pagedkv import PagedKVCache
from pagedkv.config import CacheConfig, KVFormat
from pagedkv.errors import ConfigError


@pytest.mark.parametrize("spec, kind, recent", [
    ("turboquant:recent_tokens=128", "turboquant", 128),
    ("turboquant:k=q4_0,v=q4_0,rotate_keys,recent_tokens=64", "turboquant", 64),
    ("q4:recent_tokens=32", "kvquant", 32),
    ("q8", "kvquant", 0),
    ("turboquant", "turboquant", 0),
])
def test_format_string_carries_recent_tokens(spec, kind, recent):
    fmt = KVFormat.parse(spec)
    assert (fmt.kind, fmt.recent_tokens) == (kind, recent)
    assert KVFormat.parse(str(fmt)) == fmt


def test_recent_tokens_zero_keeps_format_string_and_equality():
    assert str(KVFormat.parse("turboquant:recent_tokens=0")) == "turboquant:k=q8_0,v=q3_0"
    assert KVFormat.parse("q4:recent_tokens=0") == KVFormat.parse("q4")
    assert CacheConfig.build(kv_format="q4", recent_tokens=0) == CacheConfig.build(kv_format="q4")


def test_build_takes_recent_tokens_as_option():
    config = CacheConfig.build(kv_format="turboquant", recent_tokens=128)
    assert config.recent_tokens == 128 and config.kv_format.recent_tokens == 128
    assert CacheConfig.build(kv_format="q4:recent_tokens=32", recent_tokens=32).recent_tokens == 32
    seed = CacheConfig.build(kv_format="turboquant:recent_tokens=16", turboquant_config={"k_quant": "q8_0"})
    assert seed.recent_tokens == 16


@pytest.mark.parametrize("options, message", [
    (dict(kv_format="turboquant", recent_tokens=20), "multiple of block_size=16"),
    (dict(kv_format="turboquant:recent_tokens=8", block_size=16), "multiple of block_size=16"),
    (dict(kv_format="turboquant", recent_tokens=-16), ">= 0"),
    (dict(kv_format="turboquant", recent_tokens=True), ">= 0"),
    (dict(kv_format="off", recent_tokens=16), "needs a quantized format"),
    (dict(kv_format="off:recent_tokens=16"), "needs a quantized format"),
    (dict(kv_format="turboquant:recent_tokens=x"), "takes an integer"),
    (dict(kv_format="turboquant:recent_tokens"), "takes an integer"),
    (dict(kv_format="q4:recent_tokens=16", recent_tokens=32), "disagrees"),
])
def test_bad_recent_tokens_name_the_setting(options, message):
    with pytest.raises(ConfigError, match=message):
        CacheConfig.build(**options)


def test_off_accepts_only_zero():
    assert CacheConfig.build(kv_format="off", recent_tokens=0).recent_tokens == 0
