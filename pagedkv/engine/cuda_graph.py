"""Decode steps replayed from CUDA graphs: the model forward, the cache writes and the attention.

A decode step of a small model is mostly host time in the eager path (Python over every layer), so
it is captured once per batch-size bucket and replayed. Everything a step varies lives in static
device buffers of fixed capacity, refilled before each replay:

    input_ids, position_ids: [1, max_bs] int64      slot_mapping: [max_bs] int64 (-1: padding, not stored)
    seq_lens: [max_bs] int32                          block_table:  [max_bs, max_blocks_per_seq] int32
    query_start_loc: [max_bs + 1] int32 = 0, 1, 2, ... (one new token per sequence, never changes)

A batch of n sequences runs in the smallest bucket >= n; the rows past n are padding (no write, one
token of context) and their logits are dropped. Graphs are captured at the first decode step, when
the page tensors exist, and again whenever the pool reallocates them (dynamic growth). They need the
Triton kernels (the reference path loops over sequences in Python and cannot be captured).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .. import ops
from ..cache import PagedKVCache
from ..ops.metadata import AttentionMetadata
from .sequence import Sequence


class CUDAGraphRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, cache_kwarg: str, batch_sizes: tuple[int, ...],
                 max_blocks_per_seq: int):
        self.model = model
        self.cache = cache
        self.cache_kwarg = cache_kwarg
        self.batch_sizes = sorted(batch_sizes)
        self.device = next(model.parameters()).device
        max_bs, self.max_blocks = self.batch_sizes[-1], max_blocks_per_seq
        dev = dict(device=self.device)
        self.input_ids = torch.zeros(1, max_bs, dtype=torch.int64, **dev)
        self.position_ids = torch.zeros(1, max_bs, dtype=torch.int64, **dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, **dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, **dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, **dev)
        self.block_table = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, **dev)
        # pinned host mirrors, filled in numpy and copied up without waiting; two sets, used in turn, so a
        # step can be prepared while the copies of the step before it are still queued
        self.host = [_HostMirror(max_bs, max_blocks_per_seq, pin=self.device.type == "cuda") for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self._pages_key = None
        self.num_replays = 0
        self.num_captures = 0

    # ------------------------------------------------------------------------------------------
    def is_capturable(self) -> bool:
        """The cache's every layer runs on the Triton kernels (allocated pages, CUDA, supported format)."""
        formats = self.cache.formats
        if not formats or any(f is None for f in formats):
            return False
        return all(ops.choose_backend(self.device, self.cache.config.kernels, f)[0] == "triton" for f in formats)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1] and self.is_capturable()

    def _current_pages_key(self):
        return tuple(t.data_ptr() for p in self.cache.pages if p for t in p.values())

    def _metadata(self, bs: int) -> AttentionMetadata:
        worst = self.max_blocks * self.cache.block_size  # host-side sizing sees the longest possible context
        return AttentionMetadata(
            block_table=self.block_table[:bs], seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            slot_mapping=self.slot_mapping[:bs], token_index=None, seq_lens_cpu=[worst] * bs,
            query_start_loc_cpu=list(range(bs + 1)), block_size=self.cache.block_size)

    def _forward(self, bs: int) -> torch.Tensor:
        out = self.model(input_ids=self.input_ids[:, :bs], position_ids=self.position_ids[:, :bs], use_cache=True,
                         **{self.cache_kwarg: self.cache})
        return out.logits[0]  # [bs, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (they share one memory pool)."""
        self.graphs.clear()
        self.logits.clear()
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_table.zero_()
        for host in self.host:
            host.forget_rows()
        for bs in reversed(self.batch_sizes):
            self.cache.plan = self._metadata(bs)
            try:
                self.graphs[bs], self.logits[bs] = self._capture(bs)
            finally:
                self.cache.end_forward()
        self._pages_key = self._current_pages_key()
        self.num_captures += 1

    def _capture(self, bs: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, its logits output [bs, vocab]) for one bucket; the plan is set to the static metadata."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bs)  # warm-up: kernels compiled, lazy buffers allocated
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bs)
        torch.cuda.synchronize()
        return graph, logits

    # ------------------------------------------------------------------------------------------
    def _fill_host(self, host: "_HostMirror", seqs: list[Sequence], slots: list[list[int]], bs: int,
                   lookahead: int) -> None:
        n = len(seqs)
        ints = host.ints.numpy()
        ints[0, :n] = [s.token_ids[-1] for s in seqs]
        ints[1, :n] = [s.num_computed_tokens + lookahead for s in seqs]
        ints[2, :n] = [per[0] for per in slots]
        ints[2, n:bs] = -1
        lens = host.lens.numpy()
        lens[:n] = ints[1, :n] + 1
        lens[n:bs] = 1
        table, rows = host.table.numpy(), host.rows
        for i, s in enumerate(seqs):
            block_ids = self.cache.seqs[s.seq_id].block_ids
            state = (s.seq_id, len(block_ids))
            if rows[i] != state:
                old = rows[i]
                start = old[1] if old is not None and old[0] == s.seq_id and old[1] < len(block_ids) else 0
                table[i, start:len(block_ids)] = block_ids[start:]
                rows[i] = state
        for i in range(n, bs):
            if rows[i] is not None:
                table[i, 0] = 0
                rows[i] = None

    def run(self, seqs: list[Sequence], input_ids: torch.Tensor | None = None, lookahead: int = 0) -> torch.Tensor:
        """One decode step of `seqs`; returns logits [len(seqs), vocab] (the replay is queued, not awaited).

        Each sequence feeds its last token, or `input_ids[i]` ([len(seqs)] int64 on the device: tokens
        sampled by a step still in flight, whose position is `lookahead` (1) past the computed ones).
        Raises CacheCapacityError (cache untouched) when a new block does not fit.
        """
        n = len(seqs)
        if self._pages_key != self._current_pages_key():
            self.capture()
        seq_ids = [s.seq_id for s in seqs]
        slots = self.cache.reserve(seq_ids, [1] * n)
        try:
            if self._pages_key != self._current_pages_key():  # the reservation grew the pool
                self.capture()
            bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
            host = self.host[self._turn]
            self._turn ^= 1
            self._fill_host(host, seqs, slots, bs, lookahead)
            self.input_ids[0, :bs].copy_(host.ints[0, :bs], non_blocking=True)
            if input_ids is not None:
                self.input_ids[0, :n].copy_(input_ids)
            self.position_ids[0, :bs].copy_(host.ints[1, :bs], non_blocking=True)
            self.slot_mapping[:bs].copy_(host.ints[2, :bs], non_blocking=True)
            self.seq_lens[:bs].copy_(host.lens[:bs], non_blocking=True)
            self.block_table[:bs].copy_(host.table[:bs], non_blocking=True)
            self.graphs[bs].replay()
        except Exception:  # leave the cache as it was: the reserved slots were never written
            for seq_id in seq_ids:
                self.cache.trim(1, seq_id)
            raise
        self.num_replays += 1
        return self.logits[bs][:n]


class _HostMirror:
    """Host copies of the static buffers: ints [3, max_bs] (input ids, positions, slots), lens [max_bs],
    table [max_bs, max_blocks]; `rows` remembers which (seq_id, blocks) each table row holds."""

    def __init__(self, max_bs: int, max_blocks: int, pin: bool):
        self.ints = torch.zeros(3, max_bs, dtype=torch.int64, pin_memory=pin)
        self.lens = torch.ones(max_bs, dtype=torch.int32, pin_memory=pin)
        self.table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.rows: list[tuple[int, int] | None] = [None] * max_bs

    def forget_rows(self) -> None:
        self.rows = [None] * len(self.rows)
