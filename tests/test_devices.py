"""`device="cuda"` names the current CUDA device: the comparison on made-up devices (any machine), and a
cache given device="cuda" taking two writes of a layer from tensors on cuda:N (a GPU)."""

import pytest
import torch

from pagedkv import PagedKVCache
from pagedkv.devices import concrete_device, same_device


def current_is(index):
    return lambda device_type: index


def test_an_index_less_device_is_the_current_one():
    assert concrete_device("cuda", current_is(3)) == torch.device("cuda", 3)
    assert concrete_device(torch.device("cuda", 1), current_is(3)) == torch.device("cuda", 1)
    assert concrete_device("cpu", current_is(3)) == torch.device("cpu")
    assert concrete_device("meta", current_is(3)) == torch.device("meta")


def test_cuda_and_the_current_cuda_index_are_the_same_device():
    assert same_device("cuda", "cuda:0", current_is(0))
    assert same_device(torch.device("cuda", 2), "cuda", current_is(2))
    assert not same_device("cuda", "cuda:1", current_is(0))
    assert not same_device("cuda:0", "cuda:1", current_is(0))
    assert not same_device("cuda", "cpu", current_is(0))
    assert same_device("cpu", torch.device("cpu"), current_is(0))


def test_a_cpu_cache_still_refuses_keys_from_another_device():
    cache = PagedKVCache(block_size=4, num_blocks=4, kernels="reference")
    seq = cache.add_sequence()
    cache.begin_step([seq], [2])
    cache.write(0, torch.randn(2, 2, 8), torch.randn(2, 2, 8))
    with pytest.raises(Exception, match="on cpu, but got keys .* on meta"):
        cache.write(0, torch.randn(2, 2, 8, device="meta"), torch.randn(2, 2, 8, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_cache_takes_two_writes_of_a_layer_from_the_current_device():
    cache = PagedKVCache(block_size=4, num_blocks=8, device="cuda")
    seq = cache.add_sequence()
    for step, count in enumerate((3, 1)):
        cache.begin_step([seq], [count])
        k = torch.randn(count, 2, 64, device=torch.cuda.current_device())
        cache.write(0, k, k.clone())
        cache.end_forward()
    assert cache.pages[0]["k"].device == torch.device("cuda", torch.cuda.current_device())
    keys, _ = cache.read(seq, 0)
    assert keys.shape == (4, 2, 64)
