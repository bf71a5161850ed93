"""The scheduler: which sequences run in the next forward pass, and how many of their tokens.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, decodes (one
token each) before prefill chunks, in admission order; waiting sequences are then admitted while
budget, `max_num_seqs` and free blocks allow, starting from the blocks the prefix cache already holds.
Admission leaves headroom for the blocks the running sequences will take as they grow: a request is
admitted only if, with it, the free blocks cover the peak of their future demand (`growth_blocks`), each
growing by one token a step to its last token (prompt + max_tokens, looked ahead at most
`admission_lookahead_tokens`; one block when the client gave no max_tokens) and freeing its blocks then.
Once admission is refused it stays refused until a running sequence leaves (`can_admit`). When a running
sequence needs a block and none is free all the same (outputs that outgrow the lookahead), the most
recently admitted running sequence is preempted: its blocks are freed and it goes back to the head of
the queue, to be recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..cache import PagedKVCache
from ..prefix import PrefixCache
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One forward pass: sequence i feeds its next num_new_tokens[i] tokens (packed in this order)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # speculative decoding: of num_new_tokens[i], how many are drafted tokens (seq.spec_token_ids) to verify
    num_spec_tokens: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_verify(self) -> bool:
        return bool(self.num_spec_tokens) and any(self.num_spec_tokens)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds one token after earlier context (what CUDA graphs replay)."""
        return all(n == 1 for n in self.num_new_tokens) and all(s.num_computed_tokens > 0 for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: PagedKVCache, prefix: PrefixCache):
        self.config = config
        self.cache = cache
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.is_admission_blocked = False  # the queue's head was refused; nothing left the running set since

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether the next `schedule()` may admit a waiting request (False: a decode step of the running ones)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs and not self.is_admission_blocked

    # ------------------------------------------------------------------------------------------
    # blocks
    def free_blocks(self) -> int:
        """Blocks a step may still take: free ones, plus the growth room a dynamic pool has left."""
        cache, cfg = self.cache, self.cache.config
        if not cfg.dynamic:
            return cache.pool.num_free if cache.pool.num_blocks else cfg.num_blocks
        ctx = cfg.context_window_tokens
        if ctx is None:
            return 1 << 40
        cap = max(1, len(cache.seqs)) * cache.blocks_for(ctx)
        return max(cap, cache.pool.num_blocks) - cache.pool.num_used

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        held = len(self.cache.seqs[seq.seq_id].block_ids) if seq.seq_id in self.cache.seqs else 0
        return max(0, self.cache.blocks_for(seq.num_computed_tokens + num_new_tokens) - held)

    # ------------------------------------------------------------------------------------------
    def tokens_that_fit(self, seq: Sequence, num_blocks: int) -> int:
        """New tokens of `seq` that `num_blocks` more blocks (plus its own partial last block) can hold."""
        held = len(self.cache.seqs[seq.seq_id].block_ids) if seq.seq_id in self.cache.seqs else 0
        return max(0, (held + num_blocks) * self.cache.block_size - seq.num_computed_tokens)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        if not self.waiting and 0 < len(self.running) <= budget:  # steady decoding: everyone takes one token
            if all(s.num_uncomputed_tokens == 1 and not s.spec_token_ids for s in self.running):
                bs = self.cache.block_size
                if sum(s.num_computed_tokens % bs == 0 for s in self.running) <= self.free_blocks():
                    return ScheduledBatch(list(self.running), [1] * len(self.running))
        planned: dict[int, tuple[Sequence, int, int]] = {}  # seq_id -> (seq, tokens, blocks)
        num_spec: dict[int, int] = {}  # seq_id -> drafted tokens scheduled with its decode
        reserved = 0
        preempted = False
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            # a prefill chunk shrinks to the free blocks; with none left, the newest request makes room
            while self.tokens_that_fit(seq, self.free_blocks() - reserved) < 1:
                victim = self.running[-1]
                if victim.seq_id in planned:
                    _, vn, vneed = planned.pop(victim.seq_id)
                    budget += vn
                    reserved -= vneed
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            n = min(n, self.tokens_that_fit(seq, self.free_blocks() - reserved), budget)
            m = len(seq.spec_token_ids) if seq.num_uncomputed_tokens == 1 else 0
            if m and min(self.tokens_that_fit(seq, self.free_blocks() - reserved), budget) >= 1 + m:
                n, num_spec[seq.seq_id] = 1 + m, m  # the drafts' slots too, or none of them
            need = self.blocks_needed(seq, n)
            planned[seq.seq_id] = (seq, n, need)
            budget -= n
            reserved += need
        future = None  # (tokens after this step, tokens at the end) of each running sequence
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if future is None:
                future = [self._future(s, s.num_computed_tokens + (planned[s.seq_id][1] if s.seq_id in planned else 0),
                                       s.metrics.num_cached_tokens) for s in self.running]
            admitted = self._admit(seq, budget, reserved, future)
            self.is_admission_blocked = admitted is None
            if admitted is None:
                break
            n, need = admitted
            self.waiting.popleft()
            self.running.append(seq)
            planned[seq.seq_id] = (seq, n, need)
            budget -= n
            reserved += need
        order = [s for s in self.running if s.seq_id in planned]
        spec = [num_spec.get(s.seq_id, 0) for s in order] if num_spec else None
        return ScheduledBatch(order, [planned[s.seq_id][1] for s in order], spec)

    # ------------------------------------------------------------------------------------------
    # admission headroom
    def _future(self, seq: Sequence, num_tokens: int, num_shared: int) -> tuple[int, int]:
        """(tokens now, tokens at the end) of `seq` holding `num_tokens` after this step, counted past the
        `num_shared` tokens of its prefix-cache hits (blocks others may hold too, so not freed at its end).

        The end is its last written token (prompt + max_tokens - 1), looked ahead at most
        `admission_lookahead_tokens`; without a max_tokens from the client its length is unknown, and it is
        looked ahead one block (reserving more for outputs that mostly end early costs more batch than
        the preemptions it saves)."""
        last = seq.num_prompt_tokens + seq.params.max_tokens - 1
        lookahead = self.config.admission_lookahead_tokens if seq.has_max_tokens else self.cache.block_size
        end = max(num_tokens, min(last, num_tokens + lookahead))
        return num_tokens - num_shared, end - num_shared

    def growth_blocks(self, future: list[tuple[int, int]]) -> int:
        """The most blocks that sequences of (tokens now, tokens at the end) will take beyond the ones they hold
        now, each growing one token a step and freeing its blocks at its end: the peak comes just before one
        of them ends."""
        bs = self.cache.block_size
        now = np.array([f[0] for f in future], dtype=np.int64)
        end = np.array([f[1] for f in future], dtype=np.int64)
        held = int(((now + bs - 1) // bs).sum())
        steps = end - now
        order = np.argsort(steps, kind="stable")  # soonest end first
        now, steps = now[order], steps[order]
        # row k: the blocks of every sequence still running when sequence k ends (those after it in `order`)
        blocks = (now[None, :] + steps[:, None] + bs - 1) // bs
        blocks[np.tril_indices(len(now), -1)] = 0
        return max(0, int(blocks.sum(axis=1).max()) - held) if len(now) else 0

    def _admit(self, seq: Sequence, budget: int, reserved: int,
               future: list[tuple[int, int]]) -> tuple[int, int] | None:
        """Start `seq` in the cache from its cached prefix blocks if its first chunk fits, with room left for
        the growth of the running sequences (`future`, which gets `seq`'s when it starts) and its own
        (`growth_blocks`); (tokens, new blocks).

        The first chunk must fit whole, unless nothing else runs (then it shrinks to the free blocks and
        no headroom is kept).
        """
        bs = self.cache.block_size
        max_blocks = (len(seq) - 1) // bs  # leave at least one token to compute (its logits are needed)
        if self.cache.config.recent_tokens:  # cached blocks are quantized: the dense recent window is computed
            max_blocks = max(0, min(max_blocks, (len(seq) - self.cache.config.recent_tokens) // bs))
        # a prompt whose log-probabilities are asked for is computed whole (cached blocks would skip them)
        reuse = self.prefix.enabled and seq.params.prompt_logprobs is None
        hashes = self.prefix.block_hashes(seq.block_hashes, seq.token_ids) if reuse else []
        cached = self.prefix.match(hashes, max_blocks, free_blocks=self.free_blocks() - reserved)
        num_cached = len(cached) * bs
        n = min(len(seq) - num_cached, budget)
        free = self.free_blocks() - reserved
        need = self.cache.blocks_for(num_cached + n) - len(cached)
        if need > free and not self.running:
            n = min(n, (len(cached) + free) * bs - num_cached)
            need = self.cache.blocks_for(num_cached + n) - len(cached)
        mine = self._future(seq, num_cached + n, num_cached)
        if need > free or n < 1 or (self.running and self.config.admission_lookahead_tokens
                                    and self.growth_blocks(future + [mine]) > free - need):
            self.prefix.unmatch(cached)
            return None
        future.append(mine)
        self.prefix.record(min(max_blocks, len(hashes)), len(cached))
        self.cache.add_sequence(seq.seq_id, prefix_block_ids=cached)
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(cached)
        seq.metrics.num_cached_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
        return n, need

    # ------------------------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it back at the head of the queue (recomputed when readmitted)."""
        self.running.remove(seq)
        self.prefix.release(seq.seq_id, preempted=True)
        self.is_admission_blocked = False
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_last(self) -> None:
        if self.running:
            self.preempt(self.running[-1])

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.prefix.release(seq.seq_id)
            self.is_admission_blocked = False
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.prefix.forget(seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` (another sample of `parent`'s request, which has just computed its prompt) on `parent`'s
        blocks, shared by reference count; the first write to a shared partial block copies it."""
        self.cache.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance the sequences of a finished forward pass and register their newly full blocks."""
        bs, prefix_caching = self.cache.block_size, self.prefix.enabled
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:  # aborted while its step was in flight: its blocks are gone
                continue
            seq.num_computed_tokens += n
            if prefix_caching and seq.num_computed_tokens // bs > seq.num_registered_blocks:
                self.prefix.block_hashes(seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
                seq.num_registered_blocks = self.prefix.register(seq.seq_id, seq.block_hashes,
                                                                 seq.num_registered_blocks, seq.num_computed_tokens)
