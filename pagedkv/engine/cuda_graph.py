"""Decode steps replayed from CUDA graphs: the model forward, the cache writes and the attention.

A decode step of a small model is mostly host time in the eager path (Python over every layer), so
it is captured once per batch-size bucket and replayed. Everything a step varies lives in static
device buffers of fixed capacity, refilled before each replay:

    input_ids, position_ids: [1, max_bs] int64      slot_mapping: [max_bs] int64 (-1: padding, not stored)
    seq_lens: [max_bs] int32                          block_table:  [max_bs, max_blocks_per_seq] int32
    query_start_loc: [max_bs + 1] int32 = 0, 1, 2, ... (one new token per sequence, never changes)

All but query_start_loc are views of one flat buffer (`_StepInputs`), filled on the host in a pinned
twin and moved up with a single copy per step. The host keeps each block-table row between steps and
only writes what changed: a decode step adds at most the block of its new token.

Verify steps of speculative decoding (`query_len` = 1 + k tokens per sequence: its last token and k
drafted ones) are captured by a second runner of the same kind: ids, positions and slots then hold
`query_len` entries per sequence and query_start_loc steps by `query_len`.

A dense recent window (`recent_tokens`, `pagedkv.window`) adds its plan to the same flat buffer:

    ring_slot_mapping, ring_token_index: [max_bs * query_len] int64   (`WindowPlan.slot_mapping`, `token_index`)
    ring_rows, ring_first_block: [max_bs] int32                        (`WindowPlan.rows`, `first_block`)

The host places the step's new tokens in the rings (`RecentWindow.place`) as an eager step's plan does.
The rings are captured at a fixed capacity: rows for the largest bucket at least, and a scratch row, the
last, that no sequence holds. Padding entries write token 0 to the scratch row and read no ring block.
This needs the kernels to read the window in the step (`ops.triton.reads_window`: decode steps, verify
steps of up to 15 drafted tokens, over pages the decode kernel reads); otherwise the runner does not capture.

A batch of n sequences runs in the smallest bucket >= n; the rows past n are padding (no write,
`query_len` tokens of context) and their logits are dropped. Graphs are captured at the first decode step, when
the page tensors exist, and again whenever the pool reallocates them (dynamic growth) or the window's rings
are reallocated (an eager step wrote a ring row past their capacity, or a sequence took one in a graph step).
They need the Triton kernels (the reference path loops over sequences in Python and cannot be captured).

Under tensor parallelism every rank captures the same buckets at the same time and replays the same one
each step, with rank 0's static buffers broadcast to the others first (`pagedkv.parallel.graphs`).
"""

from __future__ import annotations

import bisect
import contextlib

import numpy as np
import torch

from .. import ops
from ..cache import PagedKVCache
from ..cache import Sequence as CacheSequence
from ..ops import metadata
from ..ops.metadata import AttentionMetadata, WindowPlan
from .sequence import Sequence


class CUDAGraphRunner:
    # prefill chunk rows after each bucket's decode rows (`MixedGraphRunner`): none here
    chunk_tokens = 0
    chunk_seqs = 0

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, cache_kwarg: str, batch_sizes: tuple[int, ...],
                 max_blocks_per_seq: int, query_len: int = 1):
        self.model = model
        self.cache = cache
        self.cache_kwarg = cache_kwarg
        self.batch_sizes = sorted(batch_sizes)
        self.device = next(model.parameters()).device
        max_bs, self.max_blocks = self.batch_sizes[-1], max_blocks_per_seq
        self.query_len = q = query_len
        self.window = window = cache.window  # the dense recent window (`recent_tokens`), or None
        self.ordered = metadata.LONGEST_FIRST  # the kernels launch the longest sequences first (a token order row)
        chunks = dict(chunk_tokens=self.chunk_tokens, chunk_seqs=self.chunk_seqs)
        self.static = _StepInputs(max_bs, max_blocks_per_seq, self.device, query_len=q, window=window is not None,
                                  order=self.ordered, **chunks)
        self.input_ids = self.static.ints[0:1]  # [1, max_bs * query_len]
        self.position_ids = self.static.ints[1:2]  # [1, max_bs * query_len]
        self.slot_mapping = self.static.ints[2]
        self.seq_lens = self.static.seq_lens
        self.block_table = self.static.block_table
        # (a mixed runner's whole step holds its chunk sequences' rows past these: placeholders, see `parts`)
        self.query_start_loc = torch.arange(max_bs + 1 + self.chunk_seqs, dtype=torch.int32, device=self.device) * q
        # pinned host twins, filled in numpy and copied up without waiting; two, used in turn, so a step can
        # be prepared while the copy of the step before it is still queued
        self.host = [_StepInputs(max_bs, max_blocks_per_seq, pin=self.device.type == "cuda", query_len=q,
                                 window=window is not None, order=self.ordered, **chunks) for _ in range(2)]
        self._turn = 0
        # per twin, the event after its last copy up: a twin is filled again only once that copy has run (the engine
        # does not wait for a mixed step that samples nothing, so steps can queue up far ahead of the GPU)
        self._copied = [torch.cuda.Event() if self.device.type == "cuda" else None for _ in self.host]
        # per bucket: the prefix of the flat buffer its graph reads, on the device and in each host twin
        rows = {bs: bs + self.chunk_seqs for bs in self.batch_sizes}
        self._copies = {bs: (self.static.prefix(rows[bs]), [host.prefix(rows[bs]) for host in self.host])
                        for bs in self.batch_sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self._pages_key = None
        self._capturable: tuple[tuple, bool] | None = None  # (layers, layers without pages): is_capturable()
        self._ring_padding = (0, 0, 0)  # what padding rows put in the window buffers (`_StepInputs.clear`)
        self.num_replays = 0
        self.num_captures = 0

    # ------------------------------------------------------------------------------------------
    def is_capturable(self) -> bool:
        """The cache's every layer runs on the Triton kernels (allocated pages, CUDA, supported format), and
        reads its dense recent window there, if it has one (decode-like steps over pages the decode kernel reads)."""
        formats = self.cache.formats
        if not formats or any(f is None for f in formats):
            return False
        if not all(ops.choose_backend(self.device, self.cache.config.kernels, f)[0] == "triton" for f in formats):
            return False
        from ..ops.triton import reads_window

        bs, q = self.batch_sizes[-1], self.query_len
        return all(reads_window(bs * q, bs, f, q)[0] for f in formats if f.spec.recent_tokens)

    def can_run(self, num_seqs: int) -> bool:
        if num_seqs > self.batch_sizes[-1]:
            return False
        formats = self.cache.formats  # a layer's format is fixed once it has pages: ask again when a layer gets them
        key = (len(formats), formats.count(None))
        if self._capturable is None or self._capturable[0] != key:
            self._capturable = (key, self.is_capturable())
        return self._capturable[1]

    def _current_pages_key(self):
        """The page tensors and the window's rings the graphs were captured over."""
        rings = () if self.window is None else (*self.window.keys.values(), *self.window.values.values())
        pages = (t for p in self.cache.pages if p for t in p.values())
        return tuple(t.data_ptr() for t in (*pages, *rings))

    def _metadata(self, bs: int) -> AttentionMetadata:
        worst = self.max_blocks * self.cache.block_size  # host-side sizing sees the longest possible context
        q, static = self.query_len, self.static
        window = None
        if self.window is not None:  # no host copies: the decode kernel reads the tensors
            window = WindowPlan(token_index=static.ints[4, :bs * q], slot_mapping=static.ints[3, :bs * q],
                                rows=static.per_seq[1, :bs], first_block=static.per_seq[2, :bs], rows_cpu=[],
                                first_block_cpu=[], num_ring_blocks=self.window.num_ring_blocks)
        return AttentionMetadata(
            block_table=self.block_table[:bs], seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            slot_mapping=self.slot_mapping[:bs * q], token_index=None, seq_lens_cpu=[worst] * bs,
            query_start_loc_cpu=[i * q for i in range(bs + 1)], block_size=self.cache.block_size,
            phase_hint="verify" if q > 1 else None, window=window,
            token_order=static.order[:bs * q] if self.ordered else None)

    def _forward(self, bs: int) -> torch.Tensor:
        num_tokens = bs * self.query_len
        out = self.model(input_ids=self.input_ids[:, :num_tokens], position_ids=self.position_ids[:, :num_tokens],
                         use_cache=True, **{self.cache_kwarg: self.cache})
        return out.logits[0]  # [bs * query_len, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (they share one memory pool); a tensor-parallel cache's peers
        capture theirs at the same time (the collectives inside the forwards pair up)."""
        self.graphs.clear()
        self.logits.clear()
        # a new memory pool for each capture (`_capture` makes it): tensors that a capture allocated and something
        # still holds keep the old pool alive with no graph using it, and PyTorch refuses to capture into it again
        self.pool = None
        with self._peers("capturing"):
            if self.window is not None:  # rings of a fixed capacity: the largest batch's rows at least, and scratch
                self.window.reserve(max(self.window.num_rows, self.batch_sizes[-1]))
                row = self.window.scratch_row
                self._ring_padding = (row * self.window.num_ring_blocks * self.cache.block_size, row, self.max_blocks)
            for copied in self._copied:   # the twins' copies up have run before they are cleared
                if copied is not None:
                    copied.synchronize()
            for inputs in (self.static, *self.host):
                inputs.clear(self._ring_padding)
            for bs in reversed(self.batch_sizes):
                self.cache.plan = self._metadata(bs)
                try:
                    self.graphs[bs], self.logits[bs] = self._capture(bs)
                finally:
                    self.cache.end_forward()
        self._pages_key = self._current_pages_key()
        self.num_captures += 1

    def replay(self, bs: int) -> None:
        """Replay bucket `bs` over what the static buffers hold (with a tensor-parallel cache's peers)."""
        with self._peers("replaying", bs):
            self.graphs[bs].replay()

    def _peers(self, phase: str, *args):
        """The cache's `peers` (a `pagedkv.parallel` sharded cache: the other ranks, which capture and replay
        with this runner, see `pagedkv.parallel.graphs`) around a capture or replay; a no-op otherwise."""
        peers = getattr(self.cache, "peers", None)
        return contextlib.nullcontext() if peers is None else getattr(peers, phase)(self, *args)

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
    def _fill_host(self, host: "_StepInputs", seqs: list[Sequence], held: list[CacheSequence],
                   slots: list[list[int]], bs: int, token_rows: list[list[int]] | None, ring: tuple | None) -> None:
        """Write the step's inputs into `host`: `held` are the cache's sequences (after the reservation);
        token_rows[i]: the query_len tokens sequence i feeds (None: they come from the device); ring: the
        window's placement of the new tokens (`RecentWindow.place`), or None."""
        n, q, block_size = len(seqs), self.query_len, self.cache.block_size
        ints, lens, table = host.np_ints, host.np_seq_lens, host.np_block_table
        if ring is not None:
            self._fill_ring(host, ring, n, bs)
        if token_rows is not None:
            ints[0, :n * q] = [t for row in token_rows for t in row]
        lens[:n] = [h.num_tokens for h in held]  # the new tokens included
        ints[1, :n * q] = (lens[:n, None] - q + np.arange(q)).reshape(-1)
        ints[2, :n * q] = [s for per in slots for s in per]
        # padding rows: token 0 at position 0, no slot (a row left as it was could hold a mixed step's PLACEHOLDER)
        ints[0:2, n * q:bs * q] = 0
        ints[2, n * q:bs * q] = -1
        lens[n:bs] = q
        if host.order is not None:
            ints[-1, :bs * q] = metadata.longest_first(lens[:bs], q)
        num_blocks = (lens[:n] + block_size - 1) // block_size
        self._update_block_table(host, held, num_blocks)
        # the new tokens' blocks (the partial last one maybe copied on write)
        table[np.repeat(np.arange(n), q), ints[1, :n * q] // block_size] = ints[2, :n * q] // block_size
        if any(r is not None for r in host.rows[n:bs]):  # padding: query_len tokens of context from block 0, never stored
            table[n:bs, :(q + block_size - 1) // block_size] = 0
            host.rows[n:bs] = [None] * (bs - n)

    def _fill_ring(self, host: "_StepInputs", ring: tuple, n: int, bs: int) -> None:
        """The window's buffers of `host` for n sequences in bucket bs: the kept new tokens' ring slots and
        their index among the step's tokens, each sequence's ring row and first block read from it. The rest
        is padding (`_StepInputs.clear`): writes of token 0 to the scratch row, nothing read from a ring."""
        token_index, ring_slots, rows, first_block = ring
        ints, per_seq, (pad_slot, pad_row, pad_first) = host.np_ints, host.np_per_seq, self._ring_padding
        kept, num_tokens = len(ring_slots), bs * self.query_len
        ints[3, :kept], ints[3, kept:num_tokens] = ring_slots, pad_slot
        ints[4, :kept], ints[4, kept:num_tokens] = token_index, 0
        per_seq[1, :n], per_seq[1, n:bs] = rows, pad_row
        per_seq[2, :n], per_seq[2, n:bs] = first_block, pad_first

    def rolled_back(self, seq_id: int, num_blocks: int) -> None:
        """Cache sequence `seq_id` now holds `num_blocks` blocks (a rollback freed the rest): the blocks it
        takes next may have other ids than the ones its table row still holds, so they are written again."""
        for host in self.host:
            for row, held in enumerate(host.rows):
                if held is not None and held.seq_id == seq_id:
                    host.num_written[row] = min(host.num_written[row], num_blocks)

    def _update_block_table(self, host: "_StepInputs", held: list[CacheSequence], num_blocks: np.ndarray) -> None:
        """Rows 0..len(held)-1 of host's block table: the first num_blocks[i] blocks of held[i].

        A row that held the same cache sequence last time it was filled lacks at most the blocks added
        since; a sequence that moved up a row (one before it finished) takes its old row along.
        """
        n, table, rows, written = len(held), host.np_block_table, host.rows, host.num_written
        if rows[:n] != held:
            before = {id(r): j for j, r in enumerate(rows) if r is not None}
            src = np.array([before.get(id(h), -1) for h in held])
            moved = np.flatnonzero((src >= 0) & (src != np.arange(n)))
            table[moved] = table[src[moved]]  # the right side is gathered into a copy first
            written[moved] = written[src[moved]]
            written[:n][src < 0] = 0
            rows[:n] = held
        for i in np.flatnonzero(written[:n] < num_blocks):
            start, end = written[i], num_blocks[i]
            table[i, start:end] = held[i].block_ids[start:end]
        written[:n] = num_blocks

    def _replay_step(self, seqs: list[Sequence], counts: list[int], num_rows: int, fill, on_device) -> int:
        """Reserve the step's slots (counts[i] new tokens of seqs[i]), capture again if the pages or rings moved, fill
        a host twin for the bucket of num_rows rows (`fill(host, held, slots, bs, ring)`), copy it up, run
        `on_device(filled)` with fill's result (work queued after the copy, before the replay) and replay; returns the
        bucket. On any failure
        the reserved slots are given back (cache untouched) and the error raised."""
        if self._pages_key != self._current_pages_key():
            self.capture()
        seq_ids = [s.seq_id for s in seqs]
        num_blocks = self.cache.pool.num_blocks
        slots = self.cache.reserve(seq_ids, counts)
        try:
            held = [self.cache.seqs[i] for i in seq_ids]
            ring = None
            if self.window is not None:
                ring = self.window.place(seq_ids, [h.num_tokens - c for h, c in zip(held, counts)], counts)
            # the reservation grew the pool (new page tensors), or a sequence took a ring row past the rings' capacity
            if self.cache.pool.num_blocks != num_blocks or (self.window is not None
                                                            and self.window.num_rows > self.window.scratch_row):
                self.capture()
            bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_rows)]
            turn = self._turn
            self._turn ^= 1
            copied = self._copied[turn]
            if copied is not None:
                copied.synchronize()
            filled = fill(self.host[turn], held, slots, bs, ring)
            static, host = self._copies[bs]
            static.copy_(host[turn], non_blocking=True)
            if copied is not None:
                copied.record()
            on_device(filled)
            self.replay(bs)
        except Exception:  # leave the cache as it was: the reserved slots were never written
            for seq_id, count in zip(seq_ids, counts):
                self.cache.trim(count, seq_id)
            raise
        self.num_replays += 1
        return bs

    def run(self, seqs: list[Sequence], token_rows: list[list[int]] | None = None,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One step of `seqs`; returns logits [len(seqs) * query_len, vocab] (the replay is queued, not awaited).

        A decode step feeds each sequence's last token, or `input_ids[i]` ([len(seqs)] int64 on the device:
        tokens sampled by a step still in flight, whose slots the cache has already reserved); a verify
        step feeds token_rows[i] (query_len tokens: the last one and the drafted ones).
        Raises CacheCapacityError (cache untouched) when a new block does not fit.
        """
        n, q = len(seqs), self.query_len
        if token_rows is None and input_ids is None:
            token_rows = [[s.token_ids[-1]] for s in seqs]

        def fill(host, held, slots, bs, ring):
            self._fill_host(host, seqs, held, slots, bs, token_rows, ring)

        def on_device(_):
            if input_ids is not None:
                self.input_ids[0, :n].copy_(input_ids)

        bs = self._replay_step(seqs, [q] * n, n, fill, on_device)
        return self.logits[bs][:n * q]


# prefill chunks (sequences) a mixed CUDA graph step holds at most
MIXED_CHUNK_SEQS = 2


class MixedGraphRunner(CUDAGraphRunner):
    """Mixed steps of at most `step_tokens` tokens replayed from CUDA graphs: a bucket's decodes, laid out as
    `CUDAGraphRunner`'s, then prefill chunks of at most `chunk_seqs` sequences, packed after the bucket's decode rows
    and padded to the bucket's chunk rows (no slot, no sequence: their outputs are never read). A bucket of bs rows
    serves n decodes for n past the bucket before it (prev), so its graph holds step_tokens - prev - 1 chunk rows: the
    most a step of step_tokens tokens can add to them (the first bucket step_tokens: a step may hold chunks alone; a
    bucket with none is not captured). Attention runs in two
    launches from device metadata alone (`AttentionMetadata.parts`: the decode kernels, then the fused varlen kernel
    over the chunks' context), so one capture per bucket serves any chunk lengths and contexts. The graph keeps the
    logits of the rows in `keep`: the decodes', then the last row of each chunk that samples (its prompt's last
    token), then the other chunks'; a replay returns those of the sampled sequences, in batch order.

    Without it such a step (every step that admits a prompt while others decode) runs eagerly: the forward's Python,
    ~15-20 ms a step at 8 layers of Llama-3-8B shape on an H200, while the GPU's part is a few ms. Chunks small
    enough to ride along decode steps (whose matrix products are bound by the weights' reads) then cost little
    (`bench/scheduler_sim.py --roofline`)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, cache_kwarg: str, batch_sizes: tuple[int, ...],
                 max_blocks_per_seq: int, step_tokens: int, chunk_seqs: int = MIXED_CHUNK_SEQS):
        sizes = sorted(batch_sizes)
        # the first bucket also serves steps of chunks alone (no decode): all step_tokens of them
        rows = {bs: step_tokens - prev - 1 for bs, prev in zip(sizes, [-1] + sizes[:-1])}
        self.chunk_rows = {bs: c for bs, c in rows.items() if c > 0}
        self.chunk_tokens, self.chunk_seqs = max(self.chunk_rows.values()), chunk_seqs
        # the buckets past the last with chunk rows stay for sizing (their decode rows), not captured
        super().__init__(model, cache, cache_kwarg, tuple(sizes), max_blocks_per_seq)
        self.batch_sizes = sorted(self.chunk_rows)
        self.keep = self.static.keep
        self.chunk_qsl = self.static.chunk_qsl

    def is_capturable(self) -> bool:
        return self.window is None and super().is_capturable()

    def can_run_mixed(self, num_decodes: int, chunk_tokens: list[int]) -> bool:
        """Whether a step of `num_decodes` decodes and then chunks of these many tokens fits a captured layout."""
        rows = max(num_decodes, 1)   # a step of chunks alone runs in the first bucket
        if not (0 < len(chunk_tokens) <= self.chunk_seqs and min(chunk_tokens) > 0 and self.can_run(rows)):
            return False
        return sum(chunk_tokens) <= self.chunk_rows[self.batch_sizes[bisect.bisect_left(self.batch_sizes, rows)]]

    def _metadata(self, bs: int) -> AttentionMetadata:
        worst = self.max_blocks * self.cache.block_size
        k, c, block_size = self.chunk_seqs, self.chunk_rows[bs], self.cache.block_size
        slots = self.slot_mapping[:bs + c]
        decodes = AttentionMetadata(
            block_table=self.block_table[:bs], seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            slot_mapping=slots[:bs], token_index=None, seq_lens_cpu=[worst] * bs,
            query_start_loc_cpu=list(range(bs + 1)), block_size=block_size,
            token_order=self.static.order[:bs] if self.ordered else None)
        chunks = AttentionMetadata(
            block_table=self.block_table[bs:bs + k], seq_lens=self.seq_lens[bs:bs + k],
            query_start_loc=self.chunk_qsl[:k + 1], slot_mapping=slots[bs:], token_index=None,
            seq_lens_cpu=[worst] * k, query_start_loc_cpu=[0] + [c] * k, block_size=block_size)
        return AttentionMetadata(
            block_table=self.block_table[:bs + k], seq_lens=self.seq_lens[:bs + k],
            query_start_loc=self.query_start_loc[:bs + k + 1], slot_mapping=slots, token_index=None,
            seq_lens_cpu=[worst] * (bs + k), query_start_loc_cpu=list(range(bs + 1)) + [bs + c] * k,
            block_size=block_size, phase_hint="mixed", parts=(decodes, chunks))

    def _forward(self, bs: int) -> torch.Tensor:
        num_tokens = bs + self.chunk_rows[bs]
        out = self.model(input_ids=self.input_ids[:, :num_tokens], position_ids=self.position_ids[:, :num_tokens],
                         logits_to_keep=self.keep[:bs + self.chunk_seqs], use_cache=True,
                         **{self.cache_kwarg: self.cache})
        return out.logits[0]  # [bs + chunk_seqs, vocab]: the rows of `keep`

    def run_mixed(self, seqs: list[Sequence], num_new_tokens: list[int], num_decodes: int, sampled: list[bool],
                  pending: tuple[torch.Tensor, dict[int, int]] | None = None) -> torch.Tensor:
        """One step of `seqs`: the first `num_decodes` feed their last token, the others num_new_tokens[i] tokens of
        a prefill chunk; sampled[j]: whether chunk j reaches its last token. `pending` as `ModelRunner.run`'s (tokens
        of the step in flight, filled into their rows on the device). Returns the logits of the decodes and of the
        sampled chunks, in order (the replay queued, not awaited). Raises CacheCapacityError (cache untouched)."""
        n = num_decodes

        def fill(host, held, slots, bs, ring):   # returns the chunks' rows
            self._fill_host(host, seqs[:n], held[:n], slots[:n], bs, [[s.token_ids[-1]] for s in seqs[:n]], None)
            return self._fill_chunks(host, seqs[n:], held[n:], slots[n:], num_new_tokens[n:], n, bs, sampled)

        def on_device(rows):
            if pending is not None:
                self._fill_pending(seqs, num_new_tokens, rows, pending)

        bs = self._replay_step(seqs, list(num_new_tokens), max(n, 1), fill, on_device)
        return self.logits[bs][:n + sum(sampled)]

    def _fill_chunks(self, host: "_StepInputs", seqs: list[Sequence], held: list[CacheSequence],
                     slots: list[list[int]], counts: list[int], num_decodes: int, bs: int,
                     sampled: list[bool]) -> list[int]:
        """The chunks' part of `host` after bucket bs's decode rows (and the `keep` row for both); returns each
        sequence's first token row in the step (decodes: their row)."""
        ints, lens, table = host.np_ints, host.np_seq_lens, host.np_block_table
        k, c, m = self.chunk_seqs, self.chunk_rows[bs], len(seqs)
        qsl = [0]
        for count in counts:
            qsl.append(qsl[-1] + count)
        t = qsl[-1]
        starts = [h.num_tokens - count for h, count in zip(held, counts)]
        ints[0, bs:bs + t] = [tok for s, a, count in zip(seqs, starts, counts) for tok in s.token_ids[a:a + count]]
        ints[1, bs:bs + t] = np.concatenate([np.arange(a, a + count) for a, count in zip(starts, counts)])
        ints[2, bs:bs + t] = [slot for per in slots for slot in per]
        ints[0:2, bs + t:bs + c] = 0
        ints[2, bs + t:bs + c] = -1  # padding rows: no slot
        lens[bs:bs + m] = [h.num_tokens for h in held]
        lens[bs + m:bs + k] = 0
        host.np_per_seq[-1, :k + 1] = qsl + [t] * (k - m)
        block_size = self.cache.block_size
        for j, h in enumerate(held):  # written whole: a chunk's row is not kept for the next step
            nb = -(-h.num_tokens // block_size)
            table[bs + j, :nb] = h.block_ids[:nb]
        host.rows[bs:bs + k] = [None] * k
        host.num_written[bs:bs + k] = 0
        last = [bs + qsl[j + 1] - 1 for j in range(m)]
        keep = (list(range(num_decodes)) + [r for r, s in zip(last, sampled) if s]
                + [r for r, s in zip(last, sampled) if not s])
        ints[host.keep_row, :bs + k] = keep + [0] * (bs + k - len(keep))
        return list(range(num_decodes)) + [bs + a for a in qsl[:-1]]

    def _fill_pending(self, seqs: list[Sequence], counts: list[int], rows: list[int],
                      pending: tuple[torch.Tensor, dict[int, int]]) -> None:
        """Input rows of sequences whose last token is still in flight (PLACEHOLDER on the host) and among the ones
        they feed (a decode's only one, a chunk's last): from the device."""
        tokens, sources = pending
        fills = []
        for seq, count, row in zip(seqs, counts, rows):
            i = sources.get(id(seq))
            offset = len(seq.token_ids) - 1 - seq.num_computed_tokens
            if i is not None and offset < count:
                fills.append((row + offset, i))
        if fills:
            at, src = zip(*fills)
            self.input_ids[0, self._queued(at, self.device)] = tokens[self._queued(src, tokens.device)]

    @staticmethod
    def _queued(values, device: torch.device) -> torch.Tensor:
        """An int64 tensor of `values` on `device`, its copy queued (pinned): a plain copy from host memory would
        wait for the step in flight."""
        t = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

class _StepInputs:
    """A step's inputs as views of one flat buffer, so one copy moves them all (host twin: pinned).

    ints: [3, max_bs * query_len] int64 (input ids, positions, slots); per_seq: [1, max_bs] int32 (seq_lens);
    block_table: [max_bs, max_blocks] int32. With a dense recent window, ints has two more rows (the ring
    slots of the kept new tokens, `WindowPlan.slot_mapping`, and their index among the step's tokens,
    `token_index`) and per_seq two more (ring rows, first blocks read from the ring). The block table comes
    last, so the inputs of a bucket of bs rows are the buffer's first `prefix(bs)` bytes. With `order`, ints has a
    last row: the step's tokens longest attention span first (`AttentionMetadata.token_order`). With chunk_tokens
    (mixed steps, `MixedGraphRunner`), ints has chunk_tokens more columns (the chunks' rows after the decodes') and
    one more row before the order (`keep`: the rows whose logits the step keeps), per_seq and the block table
    chunk_seqs more rows (the chunks' sequences after the decodes'), and per_seq one more row (`chunk_qsl`: the
    chunks' query offsets). On the host, `rows[i]` is the cache sequence whose blocks table row i holds and
    `num_written[i]` how many of them.
    """

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device | None = None, pin: bool = False,
                 query_len: int = 1, window: bool = False, order: bool = False, chunk_tokens: int = 0,
                 chunk_seqs: int = 0):
        max_tokens = max_bs * query_len + chunk_tokens
        max_rows = max_bs + chunk_seqs
        self.query_len = query_len
        self.window = window
        num_ints, num_per_seq = (5, 3) if window else (3, 1)
        mixed = chunk_tokens > 0
        num_ints += mixed + order
        num_per_seq += mixed
        ints_end = num_ints * max_tokens * 8
        self.table_start = ints_end + -(-num_per_seq * max_rows * 4 // 8) * 8
        self.row_bytes = max_blocks * 4
        self.flat = torch.zeros(self.table_start + max_rows * self.row_bytes, dtype=torch.uint8, device=device,
                                pin_memory=pin)
        self.ints = self.flat[:ints_end].view(torch.int64).view(num_ints, max_tokens)
        per_seq_end = ints_end + num_per_seq * max_rows * 4
        self.per_seq = self.flat[ints_end:per_seq_end].view(torch.int32).view(num_per_seq, max_rows)
        self.seq_lens = self.per_seq[0]
        self.order = self.ints[-1] if order else None
        # mixed steps: the rows whose logits are kept (an int row before the order) and the chunks' query offsets
        self.keep_row = num_ints - 1 - order if mixed else None
        self.keep = self.ints[self.keep_row] if mixed else None
        self.chunk_qsl = self.per_seq[-1] if mixed else None
        self.block_table = self.flat[self.table_start:].view(torch.int32).view(max_rows, max_blocks)
        if self.flat.device.type == "cpu":
            self.np_ints, self.np_per_seq, self.np_block_table = (
                t.numpy() for t in (self.ints, self.per_seq, self.block_table))
            self.np_seq_lens = self.np_per_seq[0]
        self.rows: list[CacheSequence | None] = [None] * max_rows
        self.num_written = np.zeros(max_rows, dtype=np.int64)
        self.clear()

    def prefix(self, bs: int) -> torch.Tensor:
        return self.flat[:self.table_start + bs * self.row_bytes]

    def clear(self, ring_padding: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Padding everywhere: no slot, query_len tokens of context from block 0; with a window, ring_padding
        = (slot, row, first block): every token's ring write goes to that slot (the scratch row's), every
        sequence reads that row from that block on (past its blocks: nothing)."""
        self.ints.zero_()
        self.ints[2].fill_(-1)
        self.per_seq[0].fill_(self.query_len)
        if self.order is not None:  # every token once, in grid order
            self.order.copy_(torch.arange(self.order.numel()))
        if self.window:
            self.ints[3].fill_(ring_padding[0])
            self.per_seq[1].fill_(ring_padding[1])
            self.per_seq[2].fill_(ring_padding[2])
        self.block_table.zero_()
        self.rows = [None] * len(self.rows)
        self.num_written[:] = 0
