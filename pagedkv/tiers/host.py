"""`HostTier`: full blocks in host memory (pinned on CUDA), addressed by block hash, least recently used out.

One uint8 tensor `[num_slots, block_bytes]`, allocated on first use; the owner copies rows in and out
(`layout.copy_runs`). Chains are touched tail first, so a chain's first block is always more recent than
its last and eviction removes chains from their tails.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


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

    def allocate(self, hashes: list[bytes]) -> list[int]:
        """Slots for a chain's blocks `hashes`, in order (a block stored already keeps its slot): as many as fit,
        evicting the least recently used other blocks. New blocks take the lowest free slots in ascending order,
        so a chain's rows are mostly consecutive and move in few copies. The caller fills the new slots."""
        self.storage()
        hashes = hashes[:self.num_slots]
        for h in hashes:
            if h in self._slots:
                self._slots.move_to_end(h)  # not evicted below
        new = [h for h in hashes if h not in self._slots]
        while len(self._free) < len(new):
            _, slot = self._slots.popitem(last=False)
            self._free.append(slot)
            self.num_evictions += 1
        self._free.sort(reverse=True)
        for h in new:
            self._slots[h] = self._free.pop()
        return [self._slots[h] for h in hashes]
