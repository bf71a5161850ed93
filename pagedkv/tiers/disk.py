"""`DiskTier`: full blocks as files under `kv_cache_dir`, kept across restarts, least recently used out.

    kv_cache_dir/blocks/<first 2 hex digits>/<block hash hex>.safetensors   one block (all layers) each
    kv_cache_dir/index.json                                                 hash, parent, bytes, last use
    kv_cache_dir/tmp/                                                       files being written

A block file is safetensors (tensor "block", uint8 [block_bytes]) whose header names the format, the
block's hash, its parent's hash, the digest of the identity it was written under and a CRC-32 of the
bytes; a read checks all of them and treats any mismatch as a miss (the file is removed). Writes go to
`tmp/` and are renamed into place, so a reader -- this process, or another server sharing the directory
-- sees a whole file or none. `index.json` is rewritten atomically too, and reconciled with the files at
startup (files another process wrote are added, entries without a file dropped, stale temporaries
removed). A file name is always derived from a hash (64 hex digits) and opened without following
symbolic links; a path that resolves outside the directory is refused (`TierPathError`) and never read.

Writes run on a background thread that gives way while requests run (unless its queue grows past
`high_water_bytes`). Any write error (a full disk, permissions) turns the tier off with one warning;
serving goes on without it.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import struct
import threading
import time
import warnings
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import TierPathError

BLOCK_FORMAT = "pagedkv-block"
BLOCK_VERSION = "1"
INDEX_VERSION = 1
_HEX = re.compile(r"[0-9a-f]{64}")
STALE_TMP_S = 600  # temporaries older than this are left over from a crashed process


@dataclass
class _Entry:
    parent: str
    nbytes: int
    last_used: float


class DiskTier:
    def __init__(self, directory, capacity_bytes: int, identity_digest: str, *,
                 busy: Callable[[], bool] = lambda: False, high_water_bytes: int = 256 << 20):
        self.root = Path(os.path.realpath(directory))
        self.capacity_bytes = int(capacity_bytes)
        self.identity = identity_digest
        self.busy = busy
        self.high_water_bytes = high_water_bytes
        self.enabled = True
        self.num_writes = self.num_reads = self.num_evictions = 0
        self.num_bad_files = 0  # corrupt, foreign or unreadable files treated as misses
        self.num_refused_paths = 0
        self.num_dropped_writes = 0
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # head = least recently used
        self._bytes = 0
        self._lock = threading.RLock()
        self._jobs: deque[tuple[str, str, torch.Tensor, object]] = deque()
        self._queued: set[str] = set()
        self._queued_bytes = 0
        self._active = 0  # jobs being written
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._warned: set[str] = set()
        for sub in ("blocks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._reconcile()
        self._thread = threading.Thread(target=self._run, name="pagedkv-disk-tier", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------------------------------
    # paths
    def path(self, hex_hash: str) -> Path:
        """The file of a block; raises TierPathError for a name that is not a hash or a path outside the directory."""
        if not isinstance(hex_hash, str) or not _HEX.fullmatch(hex_hash):
            raise TierPathError(f"disk tier: {hex_hash!r} is not a block hash (64 hex digits); refusing to use it as "
                                f"a file name under {self.root}")
        return self.checked(self.root / "blocks" / hex_hash[:2] / f"{hex_hash}.safetensors")

    def checked(self, path: Path) -> Path:
        """`path` if it lies under the directory and is not a symbolic link; else TierPathError."""
        real = os.path.realpath(path)
        if os.path.islink(path) or os.path.commonpath([real, str(self.root)]) != str(self.root):
            self.num_refused_paths += 1
            raise TierPathError(f"disk tier: {path} resolves to {real}, outside kv_cache_dir {self.root} (a symbolic "
                                "link or '..'); it is not read. Remove it, or point kv_cache_dir at a plain directory")
        return path

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"pagedkv: {message}", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------------------------------
    # index
    def __contains__(self, hex_hash: str) -> bool:
        return hex_hash in self._index or hex_hash in self._queued

    def __len__(self) -> int:
        return len(self._index)

    def nbytes(self) -> int:
        return self._bytes

    def touch(self, hashes_tail_first) -> None:
        now = time.time()
        with self._lock:
            for h in hashes_tail_first:
                entry = self._index.get(h)
                if entry is not None:
                    entry.last_used = now
                    self._index.move_to_end(h)

    def _reconcile(self) -> None:
        """Rebuild the index from index.json and the files actually present."""
        saved = {}
        try:
            raw = json.loads((self.root / "index.json").read_text())
            if raw.get("version") == INDEX_VERSION and raw.get("identity") == self.identity:
                saved = {e[0]: _Entry(e[1], int(e[2]), float(e[3])) for e in raw.get("blocks", [])
                         if isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and _HEX.fullmatch(e[0])}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            self._warn_once("index", f"disk tier: {self.root / 'index.json'} is unreadable ({exc}); rebuilding it "
                                     "from the block files")
        now = time.time()
        for tmp in (self.root / "tmp").iterdir():
            try:
                if not tmp.is_symlink() and now - tmp.lstat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
            except OSError:
                pass
        found = []
        for sub in sorted((self.root / "blocks").iterdir()):
            if sub.is_symlink() or not sub.is_dir():
                self._refuse_found(sub)
                continue
            for f in sub.iterdir():
                name = f.name.removesuffix(".safetensors")
                if not f.name.endswith(".safetensors") or not _HEX.fullmatch(name):
                    continue
                if f.is_symlink():
                    self._refuse_found(f)
                    continue
                size = f.lstat().st_size
                entry = saved.get(name)
                if entry is None or entry.nbytes != size:
                    header = self._read_header_only(f)
                    if header is None or header.get("identity") != self.identity:
                        continue  # another model's block, or a damaged file: never ours to use
                    entry = _Entry(header.get("parent", ""), size, f.lstat().st_mtime)
                found.append((entry.last_used, name, entry))
        for _, name, entry in sorted(found):
            self._index[name] = entry
            self._bytes += entry.nbytes
        self._evict_to(self.capacity_bytes)

    def _refuse_found(self, path: Path) -> None:
        self.num_refused_paths += 1
        self._warn_once("symlink", f"disk tier: {path} is a symbolic link or not a block file; it is ignored "
                                   "(files under kv_cache_dir are never followed outside it)")

    def _read_header_only(self, path: Path) -> dict | None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                head = f.read(8)
                (n,) = struct.unpack("<Q", head)
                meta = json.loads(f.read(min(n, 1 << 20))).get("__metadata__", {})
            return meta if meta.get("format") == BLOCK_FORMAT else None
        except (OSError, ValueError, struct.error, AttributeError):
            return None

    def save_index(self) -> None:
        with self._lock:
            blocks = [[h, e.parent, e.nbytes, e.last_used] for h, e in self._index.items()]
        body = json.dumps({"version": INDEX_VERSION, "identity": self.identity, "blocks": blocks})
        tmp = self.checked(self.root / "tmp" / f"index.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(body)
            os.replace(tmp, self.checked(self.root / "index.json"))
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._disable(exc)

    # ------------------------------------------------------------------------------------------
    # reading
    def read(self, hex_hash: str) -> torch.Tensor | None:
        """The bytes of a block ([block_bytes] uint8), or None (missing, damaged, foreign or refused: a miss)."""
        from safetensors.torch import load as load_bytes

        if not self.enabled or hex_hash not in self._index:
            return None
        try:
            path = self.path(hex_hash)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                data = f.read()
            meta = _metadata(data)
            block = load_bytes(data)["block"]
            ok = (meta.get("format") == BLOCK_FORMAT and meta.get("version") == BLOCK_VERSION
                  and meta.get("hash") == hex_hash and meta.get("identity") == self.identity
                  and meta.get("crc32") == f"{zlib.crc32(block.numpy()):08x}")
            if not ok:
                raise ValueError("header or checksum mismatch")
        except TierPathError as exc:
            self._forget(hex_hash)
            self._warn_once("refused", str(exc))
            return None
        except Exception as exc:  # missing (another process evicted it), truncated, corrupted
            self.num_bad_files += 1
            self._forget(hex_hash, unlink=not isinstance(exc, FileNotFoundError))
            self._warn_once("bad", f"disk tier: block file {hex_hash[:12]}... unusable ({type(exc).__name__}: {exc}); "
                                   "it is recomputed (further such files are counted in tier_disk_bad_files)")
            return None
        self.num_reads += 1
        return block

    def _forget(self, hex_hash: str, unlink: bool = False) -> None:
        with self._lock:
            entry = self._index.pop(hex_hash, None)
            if entry is not None:
                self._bytes -= entry.nbytes
        if unlink:
            try:
                self.path(hex_hash).unlink()
            except (OSError, TierPathError):
                pass

    # ------------------------------------------------------------------------------------------
    # writing
    def put(self, hex_hash: str, parent_hex: str, block: torch.Tensor, ready=None) -> None:
        """Queue a block for writing; `block` [block_bytes] uint8 must stay unchanged (pass a copy), `ready`
        an optional CUDA event to wait for before reading it."""
        with self._lock:
            if not self.enabled or hex_hash in self._index or hex_hash in self._queued:
                return
            if self._queued_bytes > 4 * self.high_water_bytes:
                self.num_dropped_writes += 1
                return
            self._jobs.append((hex_hash, parent_hex, block, ready))
            self._queued.add(hex_hash)
            self._queued_bytes += block.numel()
            self._wake.notify()

    def _take_job(self):
        with self._lock:
            if not self._jobs:
                return None
            self._active += 1
            return self._jobs.popleft()

    def _done_job(self, job) -> None:
        with self._lock:
            self._active -= 1
            self._queued.discard(job[0])
            self._queued_bytes = max(0, self._queued_bytes - job[2].numel())

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if self._closed and not self._jobs:
                    return
            if self.busy() and self._queued_bytes < self.high_water_bytes and not self._closed:
                time.sleep(0.01)  # give way to running requests
                continue
            self._write_next()

    def _write_next(self) -> bool:
        job = self._take_job()
        if job is None:
            return False
        try:
            self._write(*job)
        finally:
            self._done_job(job)
        if not self._jobs:
            self.save_index()
        return True

    def flush(self) -> None:
        """Write every queued block now (in the calling thread), and wait for the writer thread's current one."""
        while self._write_next() or self._active:
            if self._active and not self._jobs:
                time.sleep(0.001)

    def _write(self, hex_hash: str, parent_hex: str, block: torch.Tensor, ready) -> None:
        from safetensors.torch import save as save_bytes

        if not self.enabled or hex_hash in self._index:
            return
        if ready is not None:
            ready.synchronize()
        meta = {"format": BLOCK_FORMAT, "version": BLOCK_VERSION, "hash": hex_hash, "parent": parent_hex,
                "identity": self.identity, "crc32": f"{zlib.crc32(block.numpy()):08x}"}
        data = save_bytes({"block": block.contiguous()}, metadata=meta)
        if len(data) > self.capacity_bytes:
            return
        self._evict_to(self.capacity_bytes - len(data))
        tmp = None
        try:
            final = self.path(hex_hash)
            final.parent.mkdir(exist_ok=True)
            tmp = self.checked(self.root / "tmp" / f"{hex_hash}.{os.getpid()}.{threading.get_ident()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as exc:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self._disable(exc)
            return
        with self._lock:
            self._index[hex_hash] = _Entry(parent_hex, len(data), time.time())
            self._bytes += len(data)
        self.num_writes += 1

    def _disable(self, exc: OSError) -> None:
        if not self.enabled:
            return
        self.enabled = False
        with self._lock:
            self._jobs.clear()
            self._queued.clear()
            self._queued_bytes = 0
        reason = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "a write failed"
        self._warn_once("disabled", f"disk tier off: {reason} ({exc.strerror or exc}) under {self.root}; serving goes "
                                    "on without it. Free space or lower disk_cache_gb, then restart")

    def _evict_to(self, limit: int) -> None:
        """Remove least recently used blocks (chain tails first: see `touch`) until at most `limit` bytes remain."""
        while True:
            with self._lock:
                if self._bytes <= max(limit, 0) or not self._index:
                    return
                hex_hash, entry = self._index.popitem(last=False)
                self._bytes -= entry.nbytes
                self.num_evictions += 1
            try:
                self.path(hex_hash).unlink()
            except (OSError, TierPathError):
                pass

    def close(self) -> None:
        """Write what is queued, save the index, stop the writer thread (also run at interpreter exit)."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self.enabled:
            self.save_index()
        self._thread.join(timeout=5)


def _metadata(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]).get("__metadata__") or {}
