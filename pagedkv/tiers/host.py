"""`HostTier`: full blocks in host memory (pinned on CUDA), addressed by block hash, least recently used out.

One uint8 tensor `[num_slots, block_bytes]`, allocated on first use. Chains are touched tail first, so a
chain's first block is always more recent than its last and eviction removes chains from their tails.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .layout import words


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int, *, pin: bool):
        self.num_slots = max(0, int(capacity_bytes) // block_bytes)
        self.block_bytes = block_bytes
        self.pin = pin
        self.data: torch.Tensor | None = None  # [num_slots, block_bytes] uint8
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot; head = least recently used
        self._free: list[int] = []
        self.num_evictions = 0

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def nbytes(self) -> int:
        return len(self._slots) * self.block_bytes

    def storage(self) -> torch.Tensor:
        if self.data is None:
            self.data = torch.empty(self.num_slots, self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._free = list(range(self.num_slots - 1, -1, -1))
        return self.data

    def slot(self, block_hash: bytes) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, hashes_tail_first) -> None:
        """Mark blocks used now; pass a chain tail first so its first block ends up the most recent."""
        for h in hashes_tail_first:
            if h in self._slots:
                self._slots.move_to_end(h)

    def allocate(self, block_hash: bytes) -> int:
        """A slot for `block_hash` (evicting the least recently used block if full); the caller fills it."""
        data = self.storage()
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return self._slots[block_hash]
        if not self._free:
            _, slot = self._slots.popitem(last=False)
            self._free.append(slot)
            self.num_evictions += 1
        slot = self._free.pop()
        self._slots[block_hash] = slot
        assert data.shape[0] > slot
        return slot

    def rows(self, slots: list[int]) -> torch.Tensor:
        """The rows of `slots` as one [len(slots), block_bytes] tensor (pinned on CUDA)."""
        data = self.storage()
        out = torch.empty(len(slots), self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
        torch.index_select(words(data), 0, torch.tensor(slots, dtype=torch.long), out=words(out))
        return out

    def write(self, slot: int, row: torch.Tensor) -> None:
        """Copy one block's bytes ([block_bytes] uint8, host or device) into `slot` (non-blocking from a device)."""
        words(self.storage()[slot]).copy_(words(row), non_blocking=True)
