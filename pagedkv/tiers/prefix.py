"""`TieredPrefixCache`: the engine's prefix cache with a host tier and a disk tier under the device pool.

    release(seq)  full, computed blocks not stored below yet are copied, all layers of a block in one row,
                  to the host tier (and queued for the disk tier's writer); the device blocks stay cached
    match(hashes) device hits first; the chain goes on in the host tier, then on disk: those blocks are
                  loaded into freshly allocated device blocks (instead of being recomputed) and registered

Blocks are addressed by the chained block hash (`pagedkv.prefix`), seeded here with the digest of the
cache identity (model, page formats with their codebooks and rotations, block size, the byte layout of a
block), so the hash of a token prefix is the same in every process that would produce the same bytes,
and a restarted server finds its files. On CUDA, copies run on a side stream: an offload holds a
reference on its device blocks until its copy is done (`poll`), so compute never waits for it; a load
makes the current stream wait for its copy, which the forward pass needs anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import CacheCapacityError
from ..identity import cache_identity, digest
from ..prefix import PrefixCache
from .disk import DiskTier
from .host import HostTier
from .layout import BlockLayout, words

GB = 1 << 30


@dataclass(frozen=True)
class TierSettings:
    cpu_cache_gb: float = 0.0
    kv_cache_dir: str | None = None
    disk_cache_gb: float = 16.0
    swap_on_preemption: bool = False


class TieredPrefixCache(PrefixCache):
    def __init__(self, cache, settings: TierSettings):
        super().__init__(cache, enabled=True)
        self.settings = settings
        self.layout = BlockLayout(cache)
        identity = cache_identity(cache)
        identity["block_layout"] = self.layout.describe()
        self.identity_digest = digest(identity)
        self.page_format = f"{self.page_format}@{self.identity_digest}"  # seeds every block hash
        device = self.layout.device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.host = HostTier(int(settings.cpu_cache_gb * GB), self.layout.block_bytes, pin=self.is_cuda)
        self.disk = None
        if settings.kv_cache_dir:
            self.disk = DiskTier(settings.kv_cache_dir, int(settings.disk_cache_gb * GB), self.identity_digest,
                                 busy=lambda: bool(cache.seqs))
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._pending: list[tuple[torch.cuda.Event, list[int]]] = []  # offloads in flight, device blocks held
        self._last_match = (0, 0, 0)  # blocks from the device, the host, the disk
        self.hits = {"gpu": 0, "host": 0, "disk": 0}
        self.loaded_blocks = {"host": 0, "disk": 0}
        self.offloaded_blocks = 0
        self.load_s = self.offload_s = 0.0
        self.loaded_bytes = self.offloaded_bytes = 0

    def _disk_has(self, block_hash: bytes) -> bool:
        return self.disk is not None and self.disk.enabled and block_hash.hex() in self.disk

    # ------------------------------------------------------------------------------------------
    # the prefix-cache protocol
    def register(self, seq_id, hashes, num_registered, num_computed_tokens):
        self._seq_hashes[seq_id] = hashes  # the engine's list, extended in place as the sequence grows
        return super().register(seq_id, hashes, num_registered, num_computed_tokens)

    def match(self, hashes, max_blocks, free_blocks: int | None = None):
        """Device hits, then the chain's next blocks loaded from the host and disk tiers (at most `free_blocks`)."""
        self.poll()
        out = super().match(hashes, max_blocks)
        found = []  # (block hash, "host" | "disk")
        limit = min(max_blocks, len(hashes))
        if free_blocks is not None:
            limit = min(limit, len(out) + max(0, free_blocks))
        for h in hashes[len(out):limit]:
            tier = "host" if h in self.host else "disk" if self._disk_has(h) else None
            if tier is None:
                break
            found.append((h, tier))
        loaded = self._load(found) if found else []
        self._last_match = (len(out), sum(t == "host" for _, t in found[:len(loaded)]),
                            sum(t == "disk" for _, t in found[:len(loaded)]))
        chain = hashes[:len(out) + len(loaded)]
        self.host.touch(reversed(chain))
        if self.disk is not None:
            self.disk.touch(h.hex() for h in reversed(chain))
        return out + loaded

    def record(self, num_queried, num_hit):
        super().record(num_queried, num_hit)
        gpu, host, disk = self._last_match
        self.hits["gpu"] += gpu
        self.hits["host"] += host
        self.hits["disk"] += disk

    def release(self, seq_id, preempted: bool = False):
        self.poll()
        hashes = self._seq_hashes.pop(seq_id, None)
        if hashes and (not preempted or self.settings.swap_on_preemption):
            self._offload(seq_id, hashes)
        super().release(seq_id)

    # ------------------------------------------------------------------------------------------
    # copies
    def _load(self, found: list[tuple[bytes, str]]) -> list[int]:
        """Device blocks holding `found`'s blocks (referenced once, registered), as many as fit and read."""
        start = time.perf_counter()
        cache, pool = self.cache, self.cache.pool
        try:
            cache._ensure_free(len(found), len(cache.seqs) + 1)  # sizes (or grows) the pool like a write would
        except CacheCapacityError:
            found = found[:pool.num_free]
        disk_rows: dict[int, torch.Tensor] = {}
        num_read = 0
        for i, (h, tier) in enumerate(found):
            if tier == "disk":
                block = self.disk.read(h.hex())
                if block is None:  # damaged or gone: the chain ends here
                    break
                disk_rows[i] = block
            num_read += 1
        found = found[:num_read]
        if not found:
            return []
        if not disk_rows:
            data = self.host.rows([self.host.slot(h) for h, _ in found])  # [n, block_bytes], a copy
        else:
            storage = self.host.storage() if self.host.enabled else None
            data = torch.stack([words(disk_rows[i] if i in disk_rows else storage[self.host.slot(h)])
                                for i, (h, _) in enumerate(found)]).view(torch.uint8)
            if self.is_cuda:
                data = data.pin_memory()
        block_ids = pool.allocate(len(found))
        if self.is_cuda:
            main = torch.cuda.current_stream()
            with torch.cuda.stream(self.stream):
                self.stream.wait_stream(main)  # the pool's new blocks (and a grown pool) are ready
                self.layout.scatter(cache, block_ids, data)
                self._record_pages()
            main.wait_stream(self.stream)  # the forward pass reads these blocks
            if disk_rows:
                self.stream.synchronize()  # the host slots promoted below may still be read by a copy in flight
        else:
            self.layout.scatter(cache, block_ids, data)
        if self.host.enabled:  # promote what came from disk: the next miss on the device finds it in memory
            for i, block in disk_rows.items():
                self.host.write(self.host.allocate(found[i][0]), block)
        for b, (h, _) in zip(block_ids, found):
            pool.register_hash(b, h)
        for _, tier in found:
            self.loaded_blocks[tier] += 1
        self.loaded_bytes += data.numel()
        self.load_s += time.perf_counter() - start
        return block_ids

    def _offload(self, seq_id: int, hashes: list[bytes]) -> None:
        """Copy the sequence's full, computed blocks that a lower tier lacks into it."""
        cache, bs = self.cache, self.cache.block_size
        block_ids = cache.block_table(seq_id)
        n = min(len(hashes), cache.seq_len(seq_id) // bs, len(block_ids))
        todo = [i for i in range(n) if (self.host.enabled and hashes[i] not in self.host)
                or (self.disk is not None and self.disk.enabled and hashes[i].hex() not in self.disk)]
        if not todo:
            return
        start = time.perf_counter()
        ids = [block_ids[i] for i in todo]
        to_host = [j for j, i in enumerate(todo) if self.host.enabled and hashes[i] not in self.host]
        to_disk = [j for j, i in enumerate(todo) if self.disk is not None and self.disk.enabled
                   and hashes[i].hex() not in self.disk]
        event = None
        if self.is_cuda:
            main = torch.cuda.current_stream()
            with torch.cuda.stream(self.stream):
                self.stream.wait_stream(main)  # the blocks' last writes are done
                rows = self.layout.gather(cache, ids)  # [len(ids), block_bytes] on the device
                self._record_pages()
                self._fill_host(hashes, todo, to_host, rows)
                disk_rows = torch.empty(len(to_disk), rows.shape[1], dtype=torch.uint8, pin_memory=True)
                if to_disk:
                    words(disk_rows).copy_(words(rows[to_disk]), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            cache.pool.incref(ids)  # held until the copy is done (poll)
            self._pending.append((event, ids))
        else:
            rows = self.layout.gather(cache, ids)
            self._fill_host(hashes, todo, to_host, rows)
            disk_rows = words(rows)[to_disk].view(torch.uint8) if to_disk else rows[:0]
        for k, j in enumerate(to_disk):
            i = todo[j]
            parent = hashes[i - 1].hex() if i else ""
            self.disk.put(hashes[i].hex(), parent, disk_rows[k], ready=event)
        self.offloaded_blocks += len(todo)
        self.offloaded_bytes += len(todo) * self.layout.block_bytes
        self.offload_s += time.perf_counter() - start

    def _fill_host(self, hashes, todo, to_host, rows) -> None:
        for j in to_host:
            self.host.write(self.host.allocate(hashes[todo[j]]), rows[j])
        self.host.touch(reversed(hashes[:max(todo) + 1]))
        if self.disk is not None:
            self.disk.touch(h.hex() for h in reversed(hashes[:max(todo) + 1]))

    def _record_pages(self) -> None:
        """The side stream uses the page tensors: a pool that grows meanwhile must not hand their memory on."""
        for pages in self.cache.pages:
            for page in pages.values():
                page.record_stream(self.stream)

    def poll(self, wait: bool = False) -> None:
        """Give back the device blocks of offloads whose copies are done (all of them with `wait`)."""
        still = []
        for event, ids in self._pending:
            if wait:
                event.synchronize()
            if event.query():
                self.cache.pool.decref(reversed(ids))
            else:
                still.append((event, ids))
        self._pending = still

    def close(self) -> None:
        """Finish copies in flight and write the disk tier's queue (run at exit too)."""
        self.poll(wait=True)
        if self.disk is not None:
            self.disk.close()

    # ------------------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        out = super().as_dict()
        disk = self.disk
        out.update({
            "tier_gpu_hits": self.hits["gpu"],
            "tier_host_hits": self.hits["host"],
            "tier_disk_hits": self.hits["disk"],
            "tier_host_loaded_blocks": self.loaded_blocks["host"],
            "tier_disk_loaded_blocks": self.loaded_blocks["disk"],
            "tier_offloaded_blocks": self.offloaded_blocks,
            "tier_load_s": round(self.load_s, 4),
            "tier_offload_s": round(self.offload_s, 4),
            "tier_load_gbps": round(self.loaded_bytes / self.load_s / 1e9, 3) if self.load_s else 0.0,
            "tier_offload_gbps": round(self.offloaded_bytes / self.offload_s / 1e9, 3) if self.offload_s else 0.0,
            "tier_block_bytes": self.layout.block_bytes,
            "tier_host_blocks": len(self.host),
            "tier_host_capacity_blocks": self.host.num_slots,
            "tier_host_evictions": self.host.num_evictions,
            "tier_disk_enabled": bool(disk is not None and disk.enabled),
            "tier_disk_blocks": len(disk) if disk else 0,
            "tier_disk_bytes": disk.nbytes() if disk else 0,
            "tier_disk_writes": disk.num_writes if disk else 0,
            "tier_disk_queued": len(disk._jobs) if disk else 0,
            "tier_disk_evictions": disk.num_evictions if disk else 0,
            "tier_disk_bad_files": disk.num_bad_files if disk else 0,
            "tier_disk_refused_paths": disk.num_refused_paths if disk else 0,
        })
        return out
