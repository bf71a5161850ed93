"""Prefix caching: full blocks identified by content and shared between sequences by reference count.

A full block's hash is a pure function of (parent block's hash, its token ids, the page format), so
two sequences whose first `k * block_size` tokens agree share the hashes of their first `k` blocks,
and blocks written in one page format are never reused by a cache in another. The block pool keeps a
hash -> block map; a freed block keeps its hash and stays in the LRU free queue until allocation
evicts it, so a later request can still take it back.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence

from .cache import PagedKVCache


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], page_format: str) -> bytes:
    """The hash of one full block: sha256 over the parent's hash, the page format and the token ids."""
    h = hashlib.sha256()
    h.update(parent_hash or b"\0" * 32)
    h.update(page_format.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, page_format: str,
                        num_tokens: int | None = None) -> list[bytes]:
    """Append to `hashes` the hashes of the full blocks of `token_ids[:num_tokens]` not hashed yet; returns `hashes`."""
    num_tokens = len(token_ids) if num_tokens is None else num_tokens
    for b in range(len(hashes), num_tokens // block_size):
        parent = hashes[b - 1] if b else None
        hashes.append(hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], page_format))
    return hashes


@dataclass
class PrefixCacheStats:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0  # of those, found in the cache
    hit_tokens: int = 0

    @property
    def misses(self) -> int:
        return self.queries - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Reuse of cached full blocks for new sequences of one `PagedKVCache` (disabled: a no-op)."""

    def __init__(self, cache: PagedKVCache, enabled: bool = True):
        self.cache = cache
        self.enabled = enabled
        self.page_format = str(cache.config.kv_format.page_format)  # a dense recent window leaves pages as they are
        self.stats = PrefixCacheStats()

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def block_hashes(self, hashes: list[bytes], token_ids: Sequence[int], num_tokens: int | None = None) -> list[bytes]:
        return extend_block_hashes(hashes, token_ids, self.block_size, self.page_format, num_tokens)

    def match(self, hashes: Sequence[bytes], max_blocks: int, free_blocks: int | None = None) -> list[int]:
        """Cached blocks for the longest run of `hashes[:max_blocks]` from the start; a reference is taken on each.

        `free_blocks`: how many blocks a tiered cache may allocate to load more of the run (unused here)."""
        if not self.enabled:
            return []
        out = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cache.pool.lookup(block_hash)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def unmatch(self, block_ids: list[int]) -> None:
        """Give back the references `match` took (the blocks stay cached)."""
        self.cache.pool.decref(reversed(block_ids))

    def record(self, num_queried: int, num_hit: int) -> None:
        if self.enabled:
            self.stats.queries += num_queried
            self.stats.hits += num_hit
            self.stats.hit_tokens += num_hit * self.block_size

    def register(self, seq_id: int, hashes: Sequence[bytes], num_registered: int, num_computed_tokens: int) -> int:
        """Register the sequence's full, computed blocks from `num_registered` on; returns the new count."""
        if not self.enabled:
            return num_registered
        block_ids = self.cache.seqs[seq_id].block_ids
        upto = min(num_computed_tokens // self.block_size, len(hashes))
        for b in range(num_registered, upto):
            self.cache.pool.register_hash(block_ids[b], hashes[b])
        return max(num_registered, upto)

    def release(self, seq_id: int, preempted: bool = False) -> None:
        """Free a sequence, tail block first, so a prefix's first blocks are the last ones evicted.

        `preempted`: it will be readmitted (a tiered cache may swap its blocks out instead)."""
        self.cache.trim(self.cache.seq_len(seq_id), seq_id)  # trim frees the last block first
        self.cache.free(seq_id)

    def forget(self, seq_id: int) -> None:
        """A preempted sequence left the queue without coming back (a tiered cache drops what it kept for it)."""

    def as_dict(self) -> dict:
        return {
            "prefix_caching": self.enabled,
            "prefix_cache_queries": self.stats.queries,
            "prefix_cache_hits": self.stats.hits,
            "prefix_cache_misses": self.stats.misses,
            "prefix_cache_hit_tokens": self.stats.hit_tokens,
            "prefix_cache_hit_rate": round(self.stats.hit_rate, 4),
            "prefix_cache_evictions": self.cache.pool.num_evictions,
            "prefix_cache_blocks": self.cache.pool.num_cached(),
        }
