"""Mirroring the leader's forwards on the followers: `lead(model, group)` on rank 0, `follow(model, group)` elsewhere.

The leader runs the application unchanged (transformers `generate`, the engine's model runner). A
forward pre-hook on its model broadcasts one `ForwardStep` before every forward: the forward's inputs
and, when the forward carries a `ShardedPagedKVCache`, that cache's `CacheStep` (pool size, block
copies, mirror events, block tables and slot mapping). Followers wait in `follow`, replay the forward
with the same inputs on their shard (so the all-reduces inside the sharded model pair up) and drop the
logits. Sampling, stopping and scheduling happen on the leader alone. Leaving `lead` releases the
followers. Decode steps the engine replays from CUDA graphs reach the followers through the cache's
`peers` instead (`pagedkv.parallel.graphs`): every rank captures and replays the same graphs.

    leader:   plan (cache.begin_step / begin_forward) -> broadcast ForwardStep -> forward (collectives)
    follower:                         receive ForwardStep -> follow_step -> forward (collectives)
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..errors import ConfigError
from ..hf import switch_model
from .cache import CacheStep, ShardedPagedKVCache
from .graphs import FollowerPeers, FollowerRunners, GraphStep, LeaderPeers
from .group import TensorParallelGroup

_CACHE_KWARGS = ("cache", "past_key_values")
_cache_uids = itertools.count()


@dataclass
class ForwardStep:
    """One forward of the leader's model, as host objects."""

    args: tuple
    kwargs: dict                          # tensors on the CPU; the cache keyword left out
    grad_enabled: bool
    cache_kwarg: str | None = None        # the keyword the leader passed its cache under
    cache_uid: int | None = None          # which of the leader's caches
    cache_config: CacheConfig | None = None  # sent with a cache's first step
    cache_step: CacheStep | None = None
    dropped_caches: list[int] = field(default_factory=list)  # leader caches gone since the last step
    is_release: bool = False              # the leader left `lead`: no forward, the followers return


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _broadcast(group: TensorParallelGroup, step: ForwardStep | GraphStep | None) -> ForwardStep | GraphStep | None:
    box = [step]
    dist.broadcast_object_list(box, src=0, group=group.control)
    return box[0]


class _Leader:
    """The leader's side: numbers its caches, tells the followers about new and dropped ones."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group
        self.uids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.dropped: list[int] = []
        self.is_quiet = False  # a graph capture or replay is running the model: the followers run their own

    def _uid(self, cache: ShardedPagedKVCache) -> tuple[int, bool]:
        uid = self.uids.get(cache)
        if uid is not None:
            return uid, False
        uid = self.uids[cache] = next(_cache_uids)
        weakref.finalize(cache, self._drop, uid)
        cache.peers = LeaderPeers(self, uid)
        return uid, True

    def send(self, step: ForwardStep | GraphStep) -> None:
        """Broadcast `step` to the followers, with the caches dropped since the last one."""
        step.dropped_caches, self.dropped = self.dropped, []  # (finalizers append to the new list)
        _broadcast(self.group, step)

    @contextlib.contextmanager
    def quiet(self):
        """Forwards of the model in this block are not mirrored (a CUDA-graph capture or stand-in replay)."""
        was, self.is_quiet = self.is_quiet, True
        try:
            yield
        finally:
            self.is_quiet = was

    def release(self) -> None:
        """Tell the followers to return; this leader's caches have no followers from now on."""
        for cache in list(self.uids.keys()):
            cache.peers = None
        self.send(ForwardStep(args=(), kwargs={}, grad_enabled=False, is_release=True))

    def _drop(self, uid: int) -> None:
        self.dropped.append(uid)

    def pre_forward(self, module, args, kwargs):
        if self.is_quiet:
            return None
        step = ForwardStep(args=tuple(_to(a, "cpu") for a in args), kwargs={}, grad_enabled=torch.is_grad_enabled())
        for name, value in kwargs.items():
            if name in _CACHE_KWARGS and value is not None:
                self._attach_cache(step, name, value, args, kwargs)
            else:
                step.kwargs[name] = _to(value, "cpu")
        self.send(step)
        return None

    def _attach_cache(self, step: ForwardStep, name: str, cache, args, kwargs) -> None:
        if not isinstance(cache, ShardedPagedKVCache):
            kind = "a PagedKVCache" if isinstance(cache, PagedKVCache) else type(cache).__name__
            raise ConfigError(f"a tensor-parallel model needs a ShardedPagedKVCache but got {kind}; build it with "
                              "pagedkv.parallel.install_sharded_cache(model, ...)")
        if cache.plan is None:  # a plain transformers call: plan here, as the decoder's pre-hook would
            ref = kwargs.get("input_ids", args[0] if args else None)
            ref = ref if ref is not None else kwargs["inputs_embeds"]
            cache.begin_forward(ref.shape[0], ref.shape[1], kwargs.get("attention_mask"), ref.device)
            cache.planned_by_model = True  # the decoder's post-hook ends the forward
        uid, is_new = self._uid(cache)
        step.cache_kwarg, step.cache_uid, step.cache_step = name, uid, cache.export_step()
        step.cache_config = cache.config if is_new else None


@contextlib.contextmanager
def lead(model: torch.nn.Module, group: TensorParallelGroup):
    """On rank 0: mirror every forward of `model` on the followers while in the block; release them on leaving."""
    assert group.is_leader, "lead() runs on rank 0; the other ranks call follow()"
    leader = _Leader(group)
    handle = model.register_forward_pre_hook(leader.pre_forward, with_kwargs=True, prepend=True)
    try:
        yield leader
    finally:
        handle.remove()
        leader.release()


def follow(model: torch.nn.Module, group: TensorParallelGroup, graph_runner=None) -> list[ShardedPagedKVCache]:
    """On ranks other than 0: replay the leader's forwards and CUDA graphs until it leaves `lead`.

    graph_runner: the class of this rank's graph runners, built like the leader's when it captures
    (default `pagedkv.engine.cuda_graph.CUDAGraphRunner`; tests pass a CPU stand-in).
    Returns this rank's caches that the leader still held at the end, in the order the leader made them.
    """
    assert not group.is_leader, "rank 0 leads; follow() runs on the other ranks"
    if graph_runner is None:
        from ..engine.cuda_graph import CUDAGraphRunner as graph_runner
    caches: dict[int, ShardedPagedKVCache] = {}
    runners = FollowerRunners(model, graph_runner)
    while True:
        step = _broadcast(group, None)
        for uid in step.dropped_caches:
            caches.pop(uid, None)
            runners.drop(uid)
        if step.is_release:
            return list(caches.values())
        if isinstance(step, GraphStep):
            cache = caches[step.cache_uid]
            cache.follow_step(step.cache_step, group.device)
            runners.apply(step, cache)
            continue
        args = tuple(_to(a, group.device) for a in step.args)
        kwargs = {k: _to(v, group.device) for k, v in step.kwargs.items()}
        cache = None
        if step.cache_uid is not None:
            if step.cache_config is not None:
                switch_model(model)
                config = step.cache_config
                if config.device is not None:
                    config = replace(config, device=group.device)
                caches[step.cache_uid] = ShardedPagedKVCache(config)
                caches[step.cache_uid].peers = FollowerPeers()
            cache = caches[step.cache_uid]
            cache.follow_step(step.cache_step, group.device)
            kwargs[step.cache_kwarg] = cache
        try:
            with torch.inference_mode(not step.grad_enabled):
                model(*args, **kwargs)
        finally:
            if cache is not None:
                cache.end_forward()


def install_sharded_cache(model: torch.nn.Module, **cache_options) -> ShardedPagedKVCache:
    """`install_paged_kv_cache` for a sharded model: switch its attention, return a `ShardedPagedKVCache` (on rank 0)."""
    from ..hf import install_paged_kv_cache

    return ShardedPagedKVCache(install_paged_kv_cache(model, **cache_options).config)

