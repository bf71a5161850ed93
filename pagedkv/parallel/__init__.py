"""Tensor parallelism with torch.distributed: each rank owns a shard of the attention heads and the pages of
its own KV heads; rank 0 decides every block table and the other ranks mirror its forwards.

    results = launch(fn, world_size, "cpu")          # fn(group) on every rank (gloo on CPU, NCCL on CUDA)
    model, tokenizer = load_sharded_model(folder, group)
    if group.is_leader:
        cache = install_sharded_cache(model, kv_format="q4")
        with lead(model, group):
            model.generate(ids, cache=cache, ...)
    else:
        follow(model, group)
"""

from .cache import CacheStep, ShardedPagedKVCache
from .group import TensorParallelGroup, check_tensor_parallel, init_group
from .launcher import RankFailed, launch
from .model import check_model, load_sharded_model
from .step import ForwardStep, follow, install_sharded_cache, lead

__all__ = [
    "CacheStep", "ShardedPagedKVCache", "TensorParallelGroup", "check_tensor_parallel", "init_group", "RankFailed",
    "launch", "check_model", "load_sharded_model", "ForwardStep", "follow", "install_sharded_cache", "lead",
]
