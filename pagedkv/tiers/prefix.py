"""`TieredPrefixCache`: the engine's prefix cache with a host tier and a disk tier under the device pool.

    release(seq)  full, computed blocks not stored below yet are copied, all layers of a block in one row,
                  to the host tier (and queued for the disk tier's writer); the device blocks stay cached. A
                  preempted request's blocks (`swap_on_preemption`) are held in the host tier until it is back
                  (its next `register` or `release`) or gone (`forget`): later offloads evict other blocks
    match(hashes) device hits first; the chain goes on in the host tier, then on disk: those blocks are
                  loaded into freshly allocated device blocks (instead of being recomputed) and registered

Blocks are addressed by the chained block hash (`pagedkv.prefix`), seeded here with the digest of the
cache identity (model, page formats with their codebooks and rotations, block size, the byte layout of a
block), so the hash of a token prefix is the same in every process that would produce the same bytes,
and a restarted server finds its files.

On CUDA, a batch of blocks moves between the device pages and a device staging buffer (`BlockLayout`:
one copy per page tensor) and between that buffer and pinned host memory in one copy per run of
consecutive host slots (`copy_runs`; a chain's slots are allocated consecutively). An offload gathers on
the current stream, so its device blocks are free again in stream order as soon as they are released,
and copies to the host on the offload stream, overlapping compute. A load copies on the load stream
(host->device uses the other copy engine, so it never queues behind an offload), after any copy still
in flight into the host slots it reads (`_writing`); the current stream then waits for it, which the
forward pass needs anyway. A host slot is reused only by the offload stream, which waits for the
current stream, which waited for every earlier load: a slot is never overwritten while a load reads it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from ..errors import CacheCapacityError
from ..identity import cache_identity, digest
from ..prefix import PrefixCache
from .disk import DiskTier
from .host import HostTier
from .layout import BlockLayout, copy_runs, words

GB = 1 << 30


@dataclass(frozen=True)
class TierSettings:
    cpu_cache_gb: float = 0.0
    kv_cache_dir: str | None = None
    disk_cache_gb: float = 16.0
    swap_on_preemption: bool = False


class CopyClock:
    """Seconds and bytes of the tiers' copies, each load's or offload's from when its copies may start (after its
    stream's waits) until they are done: wall time on the CPU; on CUDA, where copies are asynchronous, the time
    between two events on the copy's stream."""

    def __init__(self):
        self.seconds = {"load": 0.0, "offload": 0.0}
        self.nbytes = {"load": 0, "offload": 0}
        self._running: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []

    def start(self, stream):
        if stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def stop(self, kind: str, started, stream, nbytes: int) -> None:
        if stream is None:
            self.seconds[kind] += time.perf_counter() - started
            self.nbytes[kind] += nbytes
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._running.append((kind, started, end, nbytes))

    def collect(self) -> None:
        """Count the copies that are done."""
        running = []
        for kind, start, end, nbytes in self._running:
            if end.query():
                self.seconds[kind] += start.elapsed_time(end) / 1e3
                self.nbytes[kind] += nbytes
            else:
                running.append((kind, start, end, nbytes))
        self._running = running

    def gbps(self, kind: str) -> float:
        return self.nbytes[kind] / self.seconds[kind] / 1e9 if self.seconds[kind] else 0.0


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
        # loads (host -> device) and offloads (device -> host) on their own streams: they use separate copy engines
        self.load_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.offload_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.host = HostTier(int(settings.cpu_cache_gb * GB), self.layout.block_bytes, pin=self.is_cuda)
        self.disk = None
        if settings.kv_cache_dir:
            self.disk = DiskTier(settings.kv_cache_dir, int(settings.disk_cache_gb * GB), self.identity_digest,
                                 busy=lambda: bool(cache.seqs))
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._swapped: dict[int, list[bytes]] = {}  # a preempted request -> its blocks held in the host tier
        self._writing: list[tuple[torch.cuda.Event, set[int]]] = []  # copies in flight into these host slots
        self._last_match = (0, 0, 0)  # blocks from the device, the host, the disk
        self.hits = {"gpu": 0, "host": 0, "disk": 0}
        self.loaded_blocks = {"host": 0, "disk": 0}
        self.offloaded_blocks = 0
        self.clock = CopyClock()

    def _disk_has(self, block_hash: bytes) -> bool:
        return self.disk is not None and self.disk.enabled and block_hash.hex() in self.disk

    def _disk_lacks(self, block_hash: bytes) -> bool:
        return self.disk is not None and self.disk.enabled and block_hash.hex() not in self.disk

    # ------------------------------------------------------------------------------------------
    # the prefix-cache protocol
    def register(self, seq_id, hashes, num_registered, num_computed_tokens):
        self.forget(seq_id)  # back in the device pool: its swapped-out blocks may be evicted again
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
        self.forget(seq_id)
        hashes = self._seq_hashes.pop(seq_id, None)
        if hashes and (not preempted or self.settings.swap_on_preemption):
            offloaded = self._offload(seq_id, hashes)
            if preempted:  # swapped out: kept until the request is back
                self._swapped[seq_id] = [h for h in offloaded if h in self.host]
                self.host.hold(self._swapped[seq_id])
        super().release(seq_id)

    def forget(self, seq_id):
        """Let the host tier evict the blocks held for a swapped-out request again (it is back, or gone)."""
        held = self._swapped.pop(seq_id, None)
        if held:
            self.host.unhold(held)

    # ------------------------------------------------------------------------------------------
    # copies
    @contextlib.contextmanager
    def _on(self, stream):
        """Queue work on `stream` after the current stream's queued work (on the CPU: run it now)."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield

    def _load(self, found: list[tuple[bytes, str]]) -> list[int]:
        """Device blocks holding `found`'s blocks (referenced once, registered), as many as fit and read."""
        cache, pool = self.cache, self.cache.pool
        try:
            cache._ensure_free(len(found), len(cache.seqs) + 1)  # sizes (or grows) the pool like a write would
        except CacheCapacityError:
            found = found[:pool.num_free]
        disk_blocks = []
        for i, (h, tier) in enumerate(found):
            if tier == "disk":
                block = self.disk.read(h.hex())
                if block is None:  # damaged or gone: the chain ends here
                    found = found[:i]
                    break
                disk_blocks.append(words(block))
        if not found:
            return []
        host_at = [i for i, (_, tier) in enumerate(found) if tier == "host"]
        disk_at = [i for i, (_, tier) in enumerate(found) if tier == "disk"]
        slots = [self.host.slot(found[i][0]) for i in host_at]
        if disk_blocks:  # [len(disk_at), block_bytes]
            disk_rows = torch.empty(len(disk_blocks), self.layout.block_bytes, dtype=torch.uint8,
                                    pin_memory=self.is_cuda)
            torch.stack(disk_blocks, out=words(disk_rows))
        block_ids = pool.allocate(len(found))
        with self._on(self.load_stream):  # after the stream that freed (or grew) the pool's blocks
            for event in self._writes_to(slots):
                self.load_stream.wait_event(event)
            started = self.clock.start(self.load_stream)  # after the waits: the clock times the copies only
            rows = torch.empty(len(found), self.layout.block_bytes, dtype=torch.uint8, device=self.layout.device)
            if slots:
                copy_runs(rows, host_at, self.host.storage(), slots)
            if disk_blocks:
                copy_runs(rows, disk_at, disk_rows, list(range(len(disk_at))))
            self.layout.scatter(cache, block_ids, rows)
            self.clock.stop("load", started, self.load_stream, rows.numel())
        if self.is_cuda:
            torch.cuda.current_stream().wait_stream(self.load_stream)  # the forward pass reads these blocks
        if disk_at and self.host.enabled:  # promoted: the next miss on the device finds them in memory
            slots = self.host.allocate([h for h, _ in found])
            promoted = [i for i in disk_at if i < len(slots)]
            self._copy_out(rows, promoted, [slots[i] for i in promoted], [])
        for b, (h, _) in zip(block_ids, found):
            pool.register_hash(b, h)
        self.loaded_blocks["host"] += len(host_at)
        self.loaded_blocks["disk"] += len(disk_at)
        return block_ids

    def _offload(self, seq_id: int, hashes: list[bytes]) -> list[bytes]:
        """Copy the sequence's full, computed blocks that a lower tier lacks into it; returns those blocks' hashes
        (stored below now, as far as the tiers had room)."""
        cache, bs = self.cache, self.cache.block_size
        block_ids = cache.block_table(seq_id)
        n = min(len(hashes), cache.seq_len(seq_id) // bs, len(block_ids))
        to_host = [i for i in range(n) if self.host.enabled and hashes[i] not in self.host]
        to_disk = [i for i in range(n) if self._disk_lacks(hashes[i])]
        todo = sorted(set(to_host) | set(to_disk))
        if not todo:
            return hashes[:n]
        # on the current stream: the blocks are free for the next writes as soon as the sequence releases them
        rows = self.layout.gather(cache, [block_ids[i] for i in todo])  # [len(todo), block_bytes] on the device
        row = {i: j for j, i in enumerate(todo)}
        slots = self.host.allocate(hashes[:n]) if to_host else []  # the chain's stored blocks keep theirs and stay
        to_host = [i for i in to_host if i < len(slots)]
        self._copy_out(rows, [row[i] for i in to_host], [slots[i] for i in to_host],
                       [(hashes[i], hashes[i - 1].hex() if i else "", row[i]) for i in to_disk])
        self.host.touch(reversed(hashes[:todo[-1] + 1]))
        if self.disk is not None:
            self.disk.touch(h.hex() for h in reversed(hashes[:todo[-1] + 1]))
        self.offloaded_blocks += len(todo)
        return hashes[:n]

    def _copy_out(self, rows: torch.Tensor, host_at: list[int], slots: list[int],
                  disk_jobs: list[tuple[bytes, str, int]]) -> None:
        """Copy device rows `host_at` into host slots `slots`, and rows for the disk writer into pinned memory
        (`disk_jobs`: block hash, parent hash hex, row); on CUDA on the offload stream, after the current stream."""
        with self._on(self.offload_stream):
            started = self.clock.start(self.offload_stream)  # after the wait for the current stream
            if slots:
                copy_runs(self.host.storage(), slots, rows, host_at)
            if disk_jobs:  # [len(disk_jobs), block_bytes], kept by the writer's queue
                disk_rows = torch.empty(len(disk_jobs), rows.shape[1], dtype=torch.uint8, pin_memory=self.is_cuda)
                copy_runs(disk_rows, list(range(len(disk_jobs))), rows, [j for _, _, j in disk_jobs])
            self.clock.stop("offload", started, self.offload_stream, (len(slots) + len(disk_jobs)) * rows.shape[1])
            event = None
            if self.is_cuda:
                rows.record_stream(self.offload_stream)  # allocated on another stream
                event = torch.cuda.Event()
                event.record(self.offload_stream)
                self._writing.append((event, set(slots)))
        for k, (h, parent, _) in enumerate(disk_jobs):
            self.disk.put(h.hex(), parent, disk_rows[k], ready=event)

    def _writes_to(self, slots: list[int]) -> list:
        """Events of the copies in flight that write any of the host slots `slots`."""
        wanted = set(slots)
        return [event for event, written in self._writing if not written.isdisjoint(wanted)]

    def poll(self, wait: bool = False) -> None:
        """Forget the copies into the host tier that are done (wait for all of them with `wait`)."""
        for event, _ in self._writing if wait else ():
            event.synchronize()
        self._writing = [(event, slots) for event, slots in self._writing if not event.query()]

    def close(self) -> None:
        """Finish copies in flight and write the disk tier's queue (run at exit too)."""
        self.poll(wait=True)
        if self.disk is not None:
            self.disk.close()

    # ------------------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        out = super().as_dict()
        disk, clock = self.disk, self.clock
        clock.collect()
        out.update({
            "tier_gpu_hits": self.hits["gpu"],
            "tier_host_hits": self.hits["host"],
            "tier_disk_hits": self.hits["disk"],
            "tier_host_loaded_blocks": self.loaded_blocks["host"],
            "tier_disk_loaded_blocks": self.loaded_blocks["disk"],
            "tier_offloaded_blocks": self.offloaded_blocks,
            "tier_load_s": round(clock.seconds["load"], 4),
            "tier_offload_s": round(clock.seconds["offload"], 4),
            "tier_load_gbps": round(clock.gbps("load"), 3),
            "tier_offload_gbps": round(clock.gbps("offload"), 3),
            "tier_block_bytes": self.layout.block_bytes,
            "tier_host_blocks": len(self.host),
            "tier_host_capacity_blocks": self.host.num_slots,
            "tier_host_held_blocks": self.host.num_held,
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
