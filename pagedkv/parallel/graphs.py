"""CUDA-graph decode steps on every rank: rank 0 plans the step, every rank replays the same graph.

A decode step replayed from a CUDA graph never calls the model in Python, so the forward pre-hook that
mirrors eager forwards (`pagedkv.parallel.step`) cannot tell the followers about it. Instead a
`ShardedPagedKVCache` carries `peers`, which its graph runner (`pagedkv.engine.cuda_graph`) calls around
every capture and every replay:

    leader:   reserve slots -> fill static buffers -> GraphStep (control)  -> broadcast static buffers -> replay
    follower:                                         receive GraphStep -> follow events -> broadcast (recv) -> replay

The step's block tables, sequence lengths, slots and input ids travel as one device tensor of fixed
capacity per bucket (the runner's flat static buffer, up to that bucket's rows), broadcast over the
default process group (NCCL on GPUs), so they never pass through the host of a follower. The control
message (`GraphStep`, gloo) only says which bucket to replay and carries the cache's rare host events (pool
growth, copy-on-write copies, mirror events). A capture message makes every rank capture the same
buckets in the same order, so the all-reduces inside the captured forwards pair up.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .cache import CacheStep


@dataclass
class GraphStep:
    """A capture or a replay of the leader's graph runner of one cache (host objects, sent over gloo)."""

    cache_uid: int
    cache_step: CacheStep                 # pool size, block copies and mirror events since the last step
    query_len: int                        # which of the cache's runners: 1 decode, 1 + k verify
    bucket: int | None = None             # replay this bucket (None: capture)
    runner: dict | None = None            # capture: the leader runner's settings (see `runner_settings`)
    dropped_caches: list[int] = field(default_factory=list)  # leader caches gone since the last step
    is_release: bool = False


def runner_settings(runner) -> dict:
    """What a follower needs to build a runner like the leader's: keyword arguments of `CUDAGraphRunner`."""
    return dict(cache_kwarg=runner.cache_kwarg, batch_sizes=tuple(runner.batch_sizes),
                max_blocks_per_seq=runner.max_blocks, query_len=runner.query_len)


def _broadcast_inputs(runner, bs: int) -> None:
    # static buffer prefix of bucket bs: [3, max_tokens] int64 ids/positions/slots, seq_lens, bs block-table rows
    dist.broadcast(runner.static.prefix(bs), src=0)


class LeaderPeers:
    """On rank 0: the followers of one cache, told to capture and to replay with the leader's runner."""

    def __init__(self, leader, cache_uid: int):
        self.leader = leader  # `pagedkv.parallel.step._Leader`: sends messages, can pause its forward hook
        self.cache_uid = cache_uid

    @contextlib.contextmanager
    def capturing(self, runner):
        self.leader.send(GraphStep(self.cache_uid, runner.cache.export_events(), runner.query_len,
                                   runner=runner_settings(runner)))
        with self.leader.quiet():  # the capture's forwards are mirrored by the followers' own capture
            yield

    @contextlib.contextmanager
    def replaying(self, runner, bs: int):
        self.leader.send(GraphStep(self.cache_uid, runner.cache.export_events(), runner.query_len, bucket=bs))
        _broadcast_inputs(runner, bs)
        with self.leader.quiet():
            yield


class FollowerPeers:
    """On the other ranks: a follower cache's runner receives rank 0's step inputs before each replay."""

    def capturing(self, runner):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def replaying(self, runner, bs: int):
        _broadcast_inputs(runner, bs)
        yield


class FollowerRunners:
    """A follower's graph runners, one per (leader cache, query_len), built from the leader's settings."""

    def __init__(self, model, make_runner):
        self.model = model
        self.make_runner = make_runner  # CUDAGraphRunner, or a stand-in with its signature
        self.runners: dict[tuple[int, int], object] = {}

    def apply(self, step: GraphStep, cache) -> None:
        """Capture or replay as the leader does (`cache` has taken step.cache_step already)."""
        key = (step.cache_uid, step.query_len)
        with torch.inference_mode():
            self._apply(key, step, cache)

    def _apply(self, key, step: GraphStep, cache) -> None:
        if step.bucket is None:
            runner = self.runners.get(key)
            if runner is None:
                s = dict(step.runner)
                runner = self.runners[key] = self.make_runner(
                    self.model, cache, s.pop("cache_kwarg"), s.pop("batch_sizes"), **s)
            runner.capture()
        else:
            self.runners[key].replay(step.bucket)

    def drop(self, cache_uid: int) -> None:
        for key in [k for k in self.runners if k[0] == cache_uid]:
            del self.runners[key]
