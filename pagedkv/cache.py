"""`PagedKVCache`: page tensors per layer, sequences and their block tables, write/trim/fork/free, stats.

Every layer shares one block table per sequence: block `b` of a sequence is row `b` of every layer's
page tensors, and a token at logical position `p` lives at slot
`table[p // block_size] * block_size + p % block_size`.

A forward pass is planned once (`begin_step`): blocks are reserved for the new tokens of each
sequence (all or nothing) and an `AttentionMetadata` is built; every layer's `update` then writes its
keys/values to those slots and the attention function reads the pages through the same metadata.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import ops
from .config import CacheConfig
from .devices import concrete_device, same_device
from .errors import CacheCapacityError, CacheMismatchError, ConfigError
from .formats import PageFormat, make_format
from .formats.base import grown
from .mirror import DequantMirror
from .ops.metadata import AttentionMetadata
from .pool import BlockPool
from .window import RecentWindow

GROWTH_FACTOR = 1.5


def _uniform(values: list):
    """One value when all layers agree, else the per-layer list (None before the first write)."""
    if not values:
        return None
    return values[0] if all(v == values[0] for v in values) else values


@dataclass
class Sequence:
    seq_id: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedKVCache(Cache):
    """A paged (optionally quantized) KV cache that transformers models accept as their `Cache`.

    Options (see `CacheConfig.build`): block_size=16, num_blocks=1024, dynamic, context_window_tokens,
    kv_format ("off", "q8", "turboquant", ...), turboquant_config, kv_quant_config, boundary_layers, dtype,
    device, kernels ("auto" | "triton" | "reference"), num_layers, recent_tokens (a dense recent window,
    `pagedkv.window`).
    """

    def __init__(self, config: CacheConfig | None = None, *, model_identity: dict | None = None, **options):
        if config is not None and options:
            raise ConfigError("pass either a CacheConfig or keyword options to PagedKVCache, not both")
        self.config = config or CacheConfig.build(**options)
        # the model the pages belong to (`pagedkv.identity.model_identity`), written into saved files' headers
        self.model_identity: dict = dict(model_identity or {})
        self.layers = []  # transformers' per-layer objects are not used: the pages live here
        self.layer_class_to_replicate = None
        self.offloading = False
        self.pool = BlockPool(0)
        self.seqs: dict[int, Sequence] = {}
        self.pages: list[dict[str, torch.Tensor] | None] = []
        self.formats: list[PageFormat | None] = []
        self.counters = ops.OpCounters()
        self.mirror = DequantMirror()  # KV-Quant: dense copies of decoded tokens, routes latched per request
        # recent_tokens=N: exact keys/values of each sequence's last blocks, beside the quantized pages
        self.window = RecentWindow(self.config.recent_tokens, self.block_size) if self.config.recent_tokens else None
        self.grow_events = 0
        self.batch_seq_ids: list[int] | None = None  # sequence of each batch row in transformers calls
        self.plan: AttentionMetadata | None = None  # the metadata of the forward in flight
        self.planned_by_model = False  # set while a switched model's forward owns the plan
        self._plan_is_implicit = False
        self._last_layer_written = -1
        self._columns = 0  # positions transformers has fed per row (padding included)
        self._pending_columns = 0
        self._next_seq_id = 0
        self._warned_dense = False

    # ------------------------------------------------------------------------------------------
    # capacity
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks backed by page tensors (after the first write), else the configured pool size."""
        return self.pool.num_blocks if self.pool.num_blocks else self.config.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _growth_cap(self, num_live_seqs: int) -> int | None:
        ctx = self.config.context_window_tokens
        if ctx is None:
            return None
        return max(1, num_live_seqs) * self.blocks_for(ctx)

    def _ensure_free(self, needed: int, num_live_seqs: int) -> None:
        """Make `needed` blocks free, growing the pool if allowed; raise CacheCapacityError otherwise."""
        if self.pool.num_blocks == 0:  # first write: size the pool
            if self.config.dynamic:
                initial = max(needed, 1)
                cap = self._growth_cap(num_live_seqs)
                if cap is not None and initial > cap:
                    raise CacheCapacityError(needed, cap, f"context window of {self.config.context_window_tokens} "
                                             f"tokens caps the pool at {cap} blocks for {num_live_seqs} sequences")
                self._resize(initial)
            else:
                if needed > self.config.num_blocks:
                    raise CacheCapacityError(needed, self.config.num_blocks,
                                             "raise num_blocks or turn on dynamic growth (dynamic=True / PAGEDKV_DYNAMIC=1)")
                self._resize(self.config.num_blocks)
            return
        free = self.pool.num_free
        if needed <= free:
            return
        if not self.config.dynamic:
            raise CacheCapacityError(needed, free, "raise num_blocks or turn on dynamic growth (dynamic=True / PAGEDKV_DYNAMIC=1)")
        target = max(math.ceil(self.pool.num_blocks * GROWTH_FACTOR), self.pool.num_used + needed)
        cap = self._growth_cap(num_live_seqs)
        if cap is not None:
            target = min(target, max(cap, self.pool.num_blocks))
            if target - self.pool.num_used < needed:
                raise CacheCapacityError(needed, target - self.pool.num_used,
                                         f"growth is capped at {cap} blocks by context_window_tokens="
                                         f"{self.config.context_window_tokens} for {num_live_seqs} live sequences")
        self._resize(target)
        self.grow_events += 1

    def _resize(self, new_num_blocks: int) -> None:
        self.pool.grow(new_num_blocks)
        for layer_pages in self.pages:
            if layer_pages is None:
                continue
            for name, page in layer_pages.items():
                layer_pages[name] = grown(page, new_num_blocks)

    # ------------------------------------------------------------------------------------------
    # sequences
    def add_sequence(self, seq_id: int | None = None, *, prefix_block_ids: list[int] | None = None) -> int:
        """A new sequence, empty or starting with full cached blocks.

        `prefix_block_ids`: full blocks holding the sequence's first `len(prefix_block_ids) * block_size`
        tokens, whose references the caller already holds (e.g. from `pool.lookup`); the sequence owns
        those references from now on and drops them on `free`/`trim`.
        """
        if seq_id is None:
            seq_id = self._next_seq_id
        if seq_id in self.seqs:
            raise ConfigError(f"sequence {seq_id} already exists in this cache")
        seq = Sequence(seq_id)
        if prefix_block_ids:
            assert all(self.pool.ref_cnt[b] > 0 for b in prefix_block_ids), "prefix blocks must be referenced"
            seq.block_ids = list(prefix_block_ids)
            seq.num_tokens = len(prefix_block_ids) * self.block_size
        self.seqs[seq_id] = seq
        self._next_seq_id = max(self._next_seq_id, seq_id + 1)
        return seq_id

    def seq_len(self, seq_id: int) -> int:
        return self.seqs[seq_id].num_tokens

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.seqs[seq_id].block_ids)

    def _seq(self, seq_id: int) -> Sequence:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ConfigError(f"no sequence {seq_id} in this cache (live: {sorted(self.seqs)})") from None

    def reserve(self, seq_ids: list[int], num_new_tokens: list[int]) -> list[list[int]]:
        """Reserve slots for new tokens of each sequence; all or nothing.

        Returns, per sequence, the slot of each new token. Raises CacheCapacityError (cache untouched)
        when the blocks do not fit.
        """
        seqs = [self._seq(s) for s in seq_ids]
        bs, ref_cnt = self.block_size, self.pool.ref_cnt  # growth extends ref_cnt in place
        new_blocks = 0
        for seq, n in zip(seqs, num_new_tokens):
            if n == 0:
                continue
            new_blocks += (seq.num_tokens + n + bs - 1) // bs - len(seq.block_ids)
            if seq.num_tokens % bs and ref_cnt[seq.block_ids[-1]] > 1:
                new_blocks += 1  # copy-on-write of a shared partial last block
        self._ensure_free(new_blocks, len(self.seqs))
        slots_per_seq = []
        for seq, n in zip(seqs, num_new_tokens):
            start, block_ids = seq.num_tokens, seq.block_ids
            if n and start % bs and ref_cnt[block_ids[-1]] > 1:
                self._copy_on_write(seq)
            need = (start + n + bs - 1) // bs - len(block_ids)
            if need > 0:
                block_ids.extend(self.pool.allocate(need))
            if n == 1:  # a decode step
                slots_per_seq.append([block_ids[start // bs] * bs + start % bs])
            elif n < 256:
                slots_per_seq.append([block_ids[p // bs] * bs + p % bs for p in range(start, start + n)])
            else:  # a prompt chunk: numpy, 3x faster than the loop at 1,024 tokens
                pos = np.arange(start, start + n)
                slots_per_seq.append((np.array(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            seq.num_tokens = start + n
        return slots_per_seq

    def _copy_on_write(self, seq: Sequence) -> None:
        old = seq.block_ids[-1]
        (new,) = self.pool.allocate(1)
        for layer_pages in self.pages:
            if layer_pages is not None:
                for page in layer_pages.values():
                    page[new].copy_(page[old])
        self.pool.decref([old])
        seq.block_ids[-1] = new

    def trim(self, num_tokens: int, seq_id: int | None = None) -> int:
        """Remove the last `num_tokens` tokens (speculative rollback), freeing whole blocks, the last one first.

        Without `seq_id`, trims every sequence of the current batch. Returns the tokens removed (per sequence).
        """
        if num_tokens < 0:
            raise ConfigError(f"trim({num_tokens}): the number of tokens to remove must be >= 0")
        targets = [seq_id] if seq_id is not None else (self.batch_seq_ids or list(self.seqs))
        removed = 0
        for sid in targets:
            seq = self._seq(sid)
            n = min(num_tokens, seq.num_tokens)
            seq.num_tokens -= n
            self.mirror.trim(sid, seq.num_tokens)
            if self.window is not None:
                self.window.trim(sid, seq.num_tokens)
            keep = self.blocks_for(seq.num_tokens)
            self.pool.decref(reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]
            removed = max(removed, n)
        if seq_id is None:
            self._columns = max(0, self._columns - removed)
        return removed

    def crop(self, max_length: int, seq_id: int | None = None) -> int:
        """Remove `-max_length` tokens when negative; keep the first `max_length` when positive. Returns tokens removed.

        `crop(0)` removes nothing: transformers calls it after every fully accepted draft of assisted
        generation (and each step of its deferred stop check), as `crop(-tokens_rejected)`.
        """
        if max_length == 0:
            return 0
        if seq_id is not None:
            current = self._seq(seq_id).num_tokens
        else:
            current = self._columns if self.batch_seq_ids else max((s.num_tokens for s in self.seqs.values()), default=0)
        to_remove = -max_length if max_length < 0 else max(0, current - max_length)
        return self.trim(to_remove, seq_id)

    def fork(self, seq_id: int, new_seq_id: int | None = None) -> int:
        """A new sequence sharing `seq_id`'s blocks by reference count; a shared partial block is copied on write."""
        src = self._seq(seq_id)
        child = self.add_sequence(new_seq_id)
        self.pool.incref(src.block_ids)
        self.seqs[child].block_ids = list(src.block_ids)
        self.seqs[child].num_tokens = src.num_tokens
        self.mirror.fork(seq_id, child)
        if self.window is not None:
            self.window.fork(seq_id, child)
        return child

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise ConfigError(f"no sequence {seq_id} in this cache")
        self.pool.decref(seq.block_ids)
        self.mirror.forget(seq_id)
        if self.window is not None:
            self.window.forget(seq_id)
        if self.batch_seq_ids and seq_id in self.batch_seq_ids:
            self.batch_seq_ids = None
            self._columns = 0

    def reset(self) -> None:
        """Forget every sequence; page tensors stay allocated for reuse."""
        self.seqs.clear()
        self.pool.reset()
        self.mirror.clear()
        if self.window is not None:
            self.window.clear()
        self.batch_seq_ids = None
        self.plan = None
        self._columns = 0
        self._pending_columns = 0
        self._next_seq_id = 0

    # ------------------------------------------------------------------------------------------
    # planning a forward pass
    def set_batch(self, seq_ids: list[int]) -> None:
        """Which sequence each batch row of the next transformers calls belongs to."""
        for s in seq_ids:
            self._seq(s)
        self.batch_seq_ids = list(seq_ids)
        self._columns = max((self.seqs[s].num_tokens for s in seq_ids), default=0)

    def begin_step(self, seq_ids: list[int], num_new_tokens: list[int], *, token_mask: torch.Tensor | None = None,
                   device: torch.device | None = None) -> AttentionMetadata:
        """Plan one forward pass: reserve slots and build the metadata every layer uses.

        Input positions are either packed (`token_mask` None: sequence i owns the next num_new_tokens[i]
        positions) or a padded [num_seqs, T] grid where `token_mask` (bool, [num_seqs, T]) marks real tokens.
        """
        device = device or self.config.device or torch.device("cpu")
        starts = [self._seq(s).num_tokens for s in seq_ids]
        slots = self.reserve(seq_ids, num_new_tokens)
        if token_mask is None:
            slot_list = np.fromiter(itertools.chain.from_iterable(slots), dtype=np.int64, count=sum(num_new_tokens))
            token_index = None
        else:
            flat_mask = token_mask.reshape(-1).cpu()
            slot_grid = torch.full((flat_mask.numel(),), -1, dtype=torch.int64)
            real = flat_mask.nonzero().flatten()
            slot_grid[real] = torch.tensor([s for per in slots for s in per], dtype=torch.int64)
            slot_list = slot_grid
            token_index = None if bool(flat_mask.all()) else real.to(device)
        seq_lens = [self.seqs[s].num_tokens for s in seq_ids]
        qsl = [0]
        for n in num_new_tokens:
            qsl.append(qsl[-1] + n)
        self.plan = AttentionMetadata(
            block_table=torch.from_numpy(self._block_table(seq_ids)).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            slot_mapping=torch.as_tensor(slot_list, dtype=torch.int64).to(device),
            token_index=token_index,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=qsl,
            block_size=self.block_size,
            seq_ids=list(seq_ids),
            window=None if self.window is None else self.window.plan(seq_ids, starts, num_new_tokens, device),
            token_order=self._token_order(seq_lens, num_new_tokens, token_mask, device),
        )
        self._plan_is_implicit = False
        self._last_layer_written = -1
        return self.plan

    def _block_table(self, seq_ids: list[int]) -> np.ndarray:
        """[len(seq_ids), longest row (at least 1)] int32: each sequence's block ids from column 0, zeros after them.
        Filled from one flat array through a row-major mask (a `torch.tensor` per row took 1 ms for 100 rows)."""
        rows = [self.seqs[s].block_ids for s in seq_ids]
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        table = np.zeros((len(rows), max(int(lens.max(initial=0)), 1)), dtype=np.int32)
        table[np.arange(table.shape[1]) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(rows), dtype=np.int32, count=int(lens.sum()))
        return table

    @staticmethod
    def _token_order(seq_lens: list[int], num_new_tokens: list[int], token_mask, device) -> torch.Tensor | None:
        """The step's query tokens longest attention span first, for the GPU decode kernels' launch order
        (`metadata.launch_order`); None for a padded batch."""
        from .ops import metadata

        return None if token_mask is not None else metadata.launch_order(seq_lens, num_new_tokens, device)

    def begin_forward(self, batch_size: int, num_columns: int, attention_mask: torch.Tensor | None,
                      device: torch.device) -> AttentionMetadata:
        """Plan a transformers forward over a [batch_size, num_columns] input (padding from the 2-D mask)."""
        if self.batch_seq_ids is None:
            if self.seqs:
                raise CacheMismatchError(
                    f"this cache holds {len(self.seqs)} sequences but no batch is bound; call cache.set_batch(seq_ids) "
                    "or cache.reset() before reusing it for a new batch")
            self.batch_seq_ids = [self.add_sequence() for _ in range(batch_size)]
        if len(self.batch_seq_ids) != batch_size:
            raise CacheMismatchError(f"the input has {batch_size} rows but the cache's batch has "
                                     f"{len(self.batch_seq_ids)} sequences; call cache.reset() for a new batch")
        token_mask = None
        counts = [num_columns] * batch_size
        if attention_mask is not None and attention_mask.dim() == 2:
            new_cols = attention_mask[:, -num_columns:].bool()
            if not bool(new_cols.all()):
                token_mask = new_cols
                counts = new_cols.sum(dim=1).tolist()
        plan = self.begin_step(self.batch_seq_ids, counts, token_mask=token_mask, device=device)
        self._pending_columns = num_columns  # counted once the forward ends (positions use the old count)
        return plan

    def end_forward(self) -> None:
        self._columns += self._pending_columns
        self._pending_columns = 0
        self.plan = None

    # ------------------------------------------------------------------------------------------
    # layers
    def init_layers(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Create the formats and (empty) pages of layers 0..num_layers-1 before any write, as a first write of
        keys [*, num_kv_heads, head_dim] in `dtype` on `device` would (restoring pages into a fresh cache)."""
        for layer_idx in range(num_layers):
            self._layer(layer_idx, torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device))

    def _layer(self, layer_idx: int, key: torch.Tensor) -> tuple[dict[str, torch.Tensor], PageFormat]:
        """The pages and format of a layer, allocated on first use from the first write's shapes."""
        while len(self.pages) <= layer_idx:
            self.pages.append(None)
            self.formats.append(None)
        num_kv_heads, head_dim = key.shape[-2], key.shape[-1]
        fmt = self.formats[layer_idx]
        if fmt is None:
            dtype = self.config.dtype or key.dtype
            device = concrete_device(key.device if self.config.device is None else self.config.device)
            spec = self.config.layer_format(layer_idx)
            fmt = make_format(spec, num_kv_heads, head_dim, dtype, device)
            self.formats[layer_idx] = fmt
            self.pages[layer_idx] = fmt.allocate_pages(self.pool.num_blocks, self.block_size)
        elif (fmt.num_kv_heads, fmt.head_dim) != (num_kv_heads, head_dim) or not same_device(fmt.device, key.device):
            raise CacheMismatchError(
                f"layer {layer_idx} holds pages for {fmt.num_kv_heads} KV heads x head_dim {fmt.head_dim} on {fmt.device}, "
                f"but got keys with {num_kv_heads} heads x {head_dim} on {key.device}; use a new cache (or cache.reset() "
                "is not enough: build a new PagedKVCache) for a different model")
        return self.pages[layer_idx], fmt

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata | None = None) -> None:
        """Write keys/values [num_input_tokens, num_kv_heads, head_dim] of one layer to the planned slots."""
        meta = meta or self.plan
        assert meta is not None, "write() outside a planned step: call begin_step() first"
        pages, fmt = self._layer(layer_idx, key)
        if key.dtype != fmt.dtype and fmt.spec.is_dense and self.config.dtype is None:
            raise CacheMismatchError(f"layer {layer_idx} pages hold {fmt.dtype} but got {key.dtype}; "
                                     "use a new cache for a model in another dtype, or set dtype= explicitly")
        key, value = key.to(fmt.dtype), value.to(fmt.dtype)
        ops.write_kv(pages, fmt, key, value, meta, kernels=self.config.kernels, counters=self.counters)
        if fmt.spec.recent_tokens:
            assert meta.window is not None, "a step planned without the dense recent window reached a cache that has one"
            if meta.token_index is not None:
                key, value = key[meta.token_index], value[meta.token_index]
            self.window.write(layer_idx, key, value, meta.window)
        self._last_layer_written = layer_idx

    def attention(self, layer_idx: int, query: torch.Tensor, *, scale: float, sliding_window: int | None = None,
                  softcap: float | None = None, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Attention of packed queries [num_tokens, num_q_heads, head_dim] over layer `layer_idx`'s pages."""
        meta = meta or self.plan
        assert meta is not None, "attention() outside a planned step: call begin_step() first"
        fmt = self.formats[layer_idx]
        mirror = self.mirror.layer(layer_idx) if fmt.spec.kind == "kvquant" else None
        window = self.window.layer(layer_idx) if fmt.spec.recent_tokens else None
        return ops.paged_attention(query, self.pages[layer_idx], fmt, meta, scale=scale,
                                   sliding_window=sliding_window, softcap=softcap,
                                   kernels=self.config.kernels, counters=self.counters, mirror=mirror, window=window)

    def read(self, seq_id: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of one sequence and layer as attention sees them: [seq_len, num_kv_heads, head_dim]
        (the pages decoded; with a dense recent window, its blocks exact from the ring)."""
        seq = self._seq(seq_id)
        fmt = self.formats[layer_idx]
        ids = torch.tensor(seq.block_ids, dtype=torch.long, device=fmt.device)
        k, v = fmt.decode(ops.reference.gather_sequence(self.pages[layer_idx], ids, seq.num_tokens))
        if fmt.spec.recent_tokens:
            first = self.window.first_dense_block(seq_id, seq.num_tokens)
            if first * self.block_size < seq.num_tokens:
                row = self.window.rings[seq_id].row
                k[first * self.block_size:], v[first * self.block_size:] = (
                    ops.reference.gather_ring(ring, row, first, seq.num_tokens, self.block_size)
                    for ring in self.window.layer(layer_idx))
        return k, v

    # ------------------------------------------------------------------------------------------
    # the transformers Cache interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [batch, num_kv_heads, T, head_dim].

        In a model switched to the "pagedkv" attention, writes them to the pages and returns them unchanged
        (the attention function reads the pages). In any other model, writes them and returns the dense
        keys/values of every row, [batch, num_kv_heads, seq_len, head_dim], for the model's own attention.
        """
        batch, _, num_cols, _ = key_states.shape
        k = key_states.transpose(1, 2).reshape(batch * num_cols, *key_states.shape[1:2], key_states.shape[-1])
        v = value_states.transpose(1, 2).reshape(batch * num_cols, *value_states.shape[1:2], value_states.shape[-1])
        if self.plan is None or (self._plan_is_implicit and layer_idx <= self._last_layer_written):
            self._begin_implicit(batch, num_cols, key_states.device)
        self.write(layer_idx, k, v)
        if not self._plan_is_implicit:
            return key_states, value_states
        return self._dense_fallback(layer_idx, key_states.dtype)

    def _begin_implicit(self, batch: int, num_cols: int, device) -> None:
        """A forward from a model not switched to "pagedkv": every column is a token; attention stays dense."""
        if not self._warned_dense:
            self._warned_dense = True
            warnings.warn("pagedkv: this model's attention is not switched to pagedkv, so the cache returns dense "
                          "keys/values (a copy of the whole context per layer); call "
                          "pagedkv.install_paged_kv_cache(model) to attend over the pages directly",
                          ops.PagedKVFallbackWarning, stacklevel=4)
        self.end_forward()  # the previous implicit forward, if any
        self.begin_forward(batch, num_cols, None, device)
        self._columns += self._pending_columns  # the model built its mask already, as with DynamicCache
        self._pending_columns = 0
        self._plan_is_implicit = True

    def _dense_fallback(self, layer_idx: int, dtype: torch.dtype):
        meta = self.plan
        self.counters.fallback_attention_calls += 1
        self.counters.bailouts[f"{meta.phase}:model_not_switched"] += 1
        keys, values = zip(*(self.read(s, layer_idx) for s in self.batch_seq_ids))
        # [batch, num_kv_heads, seq_len, head_dim]
        return (torch.stack(keys).transpose(1, 2).to(dtype), torch.stack(values).transpose(1, 2).to(dtype))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_mask_sizes(self, query_length, layer_idx: int = 0):
        if isinstance(query_length, torch.Tensor):  # older releases pass cache_position
            query_length = query_length.shape[0]
        return self._columns + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self.pages) and all(p is not None for p in self.pages)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_croppable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self.config.num_layers or len(self.pages)

    def __repr__(self) -> str:
        return (f"PagedKVCache(format={self.config.kv_format}, block_size={self.block_size}, "
                f"blocks={self.pool.num_used}/{self.num_blocks}, sequences={len(self.seqs)})")

    # Beam search: rows of the batch are reordered by moving block-table rows and reference counts, never pages;
    # beams that continue one parent share its blocks, and the first write to a shared partial block copies it.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i of the batch continues old row beam_idx[i] (beam_idx: [batch] int64)."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows in a row (sharing its blocks)."""
        if self.batch_seq_ids is not None:
            self._select_rows([i for i in range(len(self.batch_seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` ([k] int64), in that order."""
        self._select_rows(torch.as_tensor(indices).tolist())

    def _select_rows(self, rows: list[int]) -> None:
        """The batch becomes old rows `rows` (repeats allowed): an old row's sequence serves its first new row and
        is forked for each further one; sequences no new row takes are freed."""
        old = self.batch_seq_ids
        if old is None:  # nothing bound, nothing cached yet
            return
        if any(not 0 <= r < len(old) for r in rows):
            raise ConfigError(f"batch rows {rows} out of range: the cache's batch has {len(old)} rows")
        taken: set[int] = set()
        new = []
        for r in rows:
            seq_id = old[r]
            new.append(self.fork(seq_id) if seq_id in taken else seq_id)
            taken.add(seq_id)
        self.batch_seq_ids = new
        for seq_id in old:
            if seq_id not in taken:
                self.free(seq_id)

    # ------------------------------------------------------------------------------------------
    # snapshots and files (`pagedkv.snapshot`)
    def snapshot(self, seq_id: int):
        """A host-memory copy of sequence `seq_id`'s pages (a `pagedkv.snapshot.Snapshot`)."""
        from . import snapshot

        return snapshot.take(self, seq_id)

    def restore(self, snap, *, device=None) -> int:
        """A new sequence with `snap`'s pages, bit for bit; returns its id. Raises SnapshotError (another model,
        format or block size) or CacheCapacityError, leaving the cache as it was."""
        from . import snapshot

        return snapshot.restore(self, snap, device=device)

    def save(self, path, seq_ids: list[int]):
        """Write sequences `seq_ids` to a safetensors file at `path` (identity header, sha256 per tensor)."""
        from . import snapshot

        return snapshot.save(self, path, list(seq_ids))

    def load(self, path, *, device=None) -> list[int]:
        """Add the sequences saved in `path` (by `save`) as new sequences; returns their ids. Raises SnapshotError
        for a file of another model, format, block size or version, or a truncated or corrupted one (cache unchanged)."""
        from . import snapshot

        return snapshot.load(self, path, device=device)

    # ------------------------------------------------------------------------------------------
    # stats
    @property
    def key_cache(self) -> list[torch.Tensor] | None:
        """Per layer, the key page tensor [num_blocks, block_size, num_kv_heads, width]; None before the first write."""
        if not self.pages or all(p is None for p in self.pages):
            return None
        return [None if p is None else next(t for n, t in p.items() if n.startswith("k")) for p in self.pages]

    @property
    def value_cache(self) -> list[torch.Tensor] | None:
        if not self.pages or all(p is None for p in self.pages):
            return None
        return [None if p is None else next(t for n, t in p.items() if n.startswith("v")) for p in self.pages]

    def nbytes(self) -> int:
        """Bytes of the page tensors and the dense recent window's rings."""
        pages = sum(t.numel() * t.element_size() for p in self.pages if p for t in p.values())
        return pages + (self.window.nbytes() if self.window is not None else 0)

    def paged_stats(self) -> dict:
        tokens = sum(s.num_tokens for s in self.seqs.values())
        fmts = [f for f in self.formats if f is not None]
        stats = {
            "mode": str(self.config.kv_format),
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "allocated_blocks": self.pool.num_blocks,
            "used_blocks": self.pool.num_used,
            "free_blocks": self.pool.num_free,
            "capacity_tokens": self.pool.num_blocks * self.block_size,
            "tokens": tokens,
            "sequences": len(self.seqs),
            "bytes": self.nbytes(),
            "bytes_per_token": self._bytes_per_token(tokens, fmts),
            "bytes_per_token_per_head": _uniform([f.bytes_per_token_per_head() for f in fmts]),
            "grow_events": self.grow_events,
            "dynamic": self.config.dynamic,
            "context_window_tokens": self.config.context_window_tokens,
            "kernels": self.config.kernels,
        }
        stats.update(self.counters.as_dict())
        stats.update(self.mirror.stats())
        if self.window is not None:
            stats.update(self.window.stats())
        return stats

    def _bytes_per_token(self, tokens: int, fmts: list[PageFormat]) -> int | float:
        """The pages' bytes per token, plus, with a dense recent window, the rings of the live sequences spread
        over the tokens they hold."""
        per_token = sum(f.bytes_per_token() for f in fmts)
        if self.window is None or not tokens:
            return per_token
        return per_token + self.window.stats()["window_bytes_in_use"] / tokens
