"""`HostTier`: full blocks in host memory (pinned on CUDA), addressed by block hash, least recently used out.

One uint8 tensor `[num_slots, block_bytes]`, allocated on first use; the owner copies rows in and out
(`layout.copy_runs`). Chains are touched tail first, so a chain's first block is always more recent than
its last and eviction removes chains from their tails. Blocks held (`hold`: a preempted request's, swapped out
until it is back) are never evicted.
"""

from __future__ import annotations

import itertools
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
        self._held: dict[bytes, int] = {}  # hash -> holds on it (requests swapped out with this block)
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
        evicting the least recently used other blocks that are not held; a prefix of the chain when held blocks
        leave too little room. New blocks take the lowest free slots in ascending order, so a chain's rows are
        mostly consecutive and move in few copies. The caller fills the new slots."""
        self.storage()
        hashes = hashes[:self.num_slots]
        for h in hashes:
            if h in self._slots:
                self._slots.move_to_end(h)  # not evicted below
        short = sum(h not in self._slots for h in hashes) - len(self._free)
        if short > 0:
            chain = set(hashes)
            victims = list(itertools.islice((h for h in self._slots if h not in self._held and h not in chain), short))
            for h in victims:
                self._free.append(self._slots.pop(h))
            self.num_evictions += len(victims)
        self._free.sort(reverse=True)
        slots = []
        for h in hashes:
            if h not in self._slots:
                if not self._free:
                    break
                self._slots[h] = self._free.pop()
            slots.append(self._slots[h])
        return slots

    def hold(self, hashes) -> None:
        """Keep these stored blocks from eviction until as many `unhold`s."""
        for h in hashes:
            if h in self._slots:
                self._held[h] = self._held.get(h, 0) + 1

    def unhold(self, hashes) -> None:
        for h in hashes:
            count = self._held.get(h)
            if count is not None:
                if count > 1:
                    self._held[h] = count - 1
                else:
                    del self._held[h]

    @property
    def num_held(self) -> int:
        return len(self._held)
