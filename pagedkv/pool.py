"""The block allocator: plain Python, no tensors.

Block ids index row `b` of every layer's page tensor. A block is in use while its reference count is
positive. Freed blocks go to the tail of an LRU free queue and keep their prefix hash, so a later
request with the same prefix can take them back (`lookup`) until they are evicted: allocation takes
blocks from the head of the queue, evicting the least recently freed cached block first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int = 0):
        self.num_blocks = 0
        self.ref_cnt: list[int] = []
        self.block_hash: list[Hashable | None] = []
        self._free: OrderedDict[int, None] = OrderedDict()  # head = next to allocate (LRU)
        self._cached: dict[Hashable, int] = {}  # prefix hash -> block id
        self.num_evictions = 0
        self.grow(num_blocks)

    # -- capacity -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def grow(self, new_num_blocks: int) -> None:
        """Add blocks `num_blocks .. new_num_blocks-1` to the free queue (after the existing ones)."""
        assert new_num_blocks >= self.num_blocks, "a pool never shrinks"
        for block_id in range(self.num_blocks, new_num_blocks):
            self.ref_cnt.append(0)
            self.block_hash.append(None)
            self._free[block_id] = None
        self.num_blocks = new_num_blocks

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (reference count 1). The caller has checked `num_free >= n`."""
        assert n <= len(self._free), f"allocate({n}) with only {len(self._free)} free blocks"
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict_hash(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"incref of free block {block_id}"
            self.ref_cnt[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free queue's tail."""
        ref_cnt, free = self.ref_cnt, self._free
        for block_id in block_ids:
            count = ref_cnt[block_id]
            assert count > 0, f"block {block_id} freed twice"
            ref_cnt[block_id] = count - 1
            if count == 1:
                free[block_id] = None

    def reset(self) -> None:
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self.ref_cnt = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self._cached.clear()

    # -- prefix cache ---------------------------------------------------------------------------
    def register_hash(self, block_id: int, block_hash: Hashable) -> None:
        """Mark a full, in-use block as holding the tokens identified by `block_hash`."""
        assert self.ref_cnt[block_id] > 0, f"hashing free block {block_id}"
        if block_hash in self._cached or self.block_hash[block_id] is not None:
            return  # the same content is already cached under another block, or this block is
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def lookup(self, block_hash: Hashable) -> int | None:
        """A cached block for `block_hash`, now referenced once more (taken off the free queue if idle)."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self.ref_cnt[block_id] == 0:
            del self._free[block_id]
        self.ref_cnt[block_id] += 1
        return block_id

    def num_cached(self) -> int:
        return len(self._cached)

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            del self._cached[block_hash]
            self.num_evictions += 1

    def check(self) -> None:
        """Invariants, for tests: free blocks have no references and every id is accounted for once."""
        for block_id in range(self.num_blocks):
            is_free = block_id in self._free
            assert is_free == (self.ref_cnt[block_id] == 0), f"block {block_id}: free={is_free} ref={self.ref_cnt[block_id]}"
        for block_hash, block_id in self._cached.items():
            assert self.block_hash[block_id] == block_hash
