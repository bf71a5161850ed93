"""Sequence snapshots and cache files: a sequence's pages copied to host memory, or to a safetensors file.

    take(cache, seq_id)     -> Snapshot: per layer {page name: [num_tokens, num_kv_heads, width]} on the host
    restore(cache, snap)    -> a new sequence whose pages hold the same bytes (a fork across time)
    save(cache, path, ids)  -> one safetensors file (never pickle): the tensors of each sequence, and a header
                               with the cache identity (`pagedkv.identity`), the file version and a sha256 per tensor
    load(cache, path)       -> the saved sequences, added to `cache` as new sequences

Tokens are stored as they sit in the pages (packed codes and scales for quantized formats), so a round
trip is bit-exact for every format. Everything is checked before the cache is touched: a file for
another model, page format, block size or file version, a truncated file or a flipped bit raises
`SnapshotError` naming the problem, and the cache is left as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CacheCapacityError, SnapshotError
from .formats.base import read_positions, write_slots
from .identity import cache_identity, differences

FILE_FORMAT = "pagedkv-snapshot"
FILE_VERSION = 1


@dataclass
class Snapshot:
    """One sequence's pages on the host. layers[i]: {page name: [num_tokens, num_kv_heads, width]}."""

    identity: dict
    num_tokens: int
    layers: list[dict[str, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def take(cache, seq_id: int) -> Snapshot:
    """A host copy of sequence `seq_id`'s tokens in every layer (packed as in the pages)."""
    num_tokens = cache.seq_len(seq_id)
    if not cache.formats or any(f is None for f in cache.formats):
        raise SnapshotError("this cache has no pages yet: run a forward pass (or restore a snapshot) before "
                            "taking a snapshot")
    layers = []
    for pages, fmt in zip(cache.pages, cache.formats):
        ids = torch.tensor(cache.block_table(seq_id), dtype=torch.long, device=fmt.device)
        positions = torch.arange(num_tokens, device=fmt.device)
        layers.append({name: _to_host(read_positions(page, ids, positions)) for name, page in pages.items()})
    if any(f.device.type == "cuda" for f in cache.formats):
        torch.cuda.synchronize()
    return Snapshot(cache_identity(cache), num_tokens, layers)


def _has_layers(cache) -> bool:
    return bool(cache.formats) and all(f is not None for f in cache.formats)


def _check_identity(cache, snap: Snapshot, device) -> tuple[int, int, torch.dtype] | None:
    """Refuse a snapshot that does not match `cache`. For a cache without layers yet, compares with the
    layers it would get from the snapshot's shapes and returns those shapes (nothing is created here)."""
    layers = snap.identity.get("layers") or []
    formats, shapes = None, None
    if not _has_layers(cache) and layers and isinstance(layers[0], dict):
        from .formats import make_format

        first = layers[0]
        dtype = getattr(torch, str(first.get("dtype")), None)
        if isinstance(dtype, torch.dtype) and isinstance(first.get("num_kv_heads"), int) \
                and isinstance(first.get("head_dim"), int):
            shapes = (first["num_kv_heads"], first["head_dim"], dtype)
            num_layers = cache.config.num_layers or len(layers)
            formats = [make_format(cache.config.layer_format(i), first["num_kv_heads"], first["head_dim"],
                                   cache.config.dtype or dtype, cache.config.device or device)
                       for i in range(num_layers)]
    wrong = differences(snap.identity, cache_identity(cache, formats))
    if wrong:
        raise SnapshotError("these pages were saved for another model or cache configuration: "
                            + "; ".join(wrong[:6]) + (f" (and {len(wrong) - 6} more)" if len(wrong) > 6 else "")
                            + ". Load them into a cache built with the same model, page format and block size")
    for layer, fmt in zip(snap.layers, formats or cache.formats):
        for name, (width, dtype) in fmt.page_spec().items():
            t = layer.get(name)
            if t is None or tuple(t.shape) != (snap.num_tokens, fmt.num_kv_heads, width) or t.dtype != dtype:
                raise SnapshotError(f"page tensor {name!r} has shape {None if t is None else tuple(t.shape)}, "
                                    f"expected {(snap.num_tokens, fmt.num_kv_heads, width)} {dtype}; the snapshot is damaged")
    return shapes


def restore(cache, snap: Snapshot, *, device=None) -> int:
    """Add a new sequence holding `snap`'s tokens; returns its id. Raises SnapshotError on a mismatch and
    CacheCapacityError when the blocks do not fit (the cache is left as it was in both cases)."""
    return restore_many(cache, [snap], device=device)[0]


def restore_many(cache, snaps: list[Snapshot], *, device=None) -> list[int]:
    """Restore every snapshot, or none of them."""
    device = device or cache.config.device or "cpu"
    shapes = [_check_identity(cache, snap, device) for snap in snaps]
    if len(set(shapes)) > 1:
        raise SnapshotError(f"these snapshots hold pages of different shapes {sorted(set(map(str, shapes)))}; "
                            "restore them into separate caches")
    if shapes and shapes[0] is not None:  # a cache without layers yet gets the snapshot's
        num_layers = cache.config.num_layers or len(snaps[0].layers)
        cache.init_layers(num_layers, *shapes[0], device=device)
    added = []
    try:
        for snap in snaps:
            seq_id = cache.add_sequence()
            added.append(seq_id)
            (slots,) = cache.reserve([seq_id], [snap.num_tokens])
            for pages, layer in zip(cache.pages, snap.layers):
                for name, page in pages.items():
                    index = torch.tensor(slots, dtype=torch.long, device=page.device)
                    with torch.inference_mode(page.is_inference()):  # pages grown inside a forward are inference tensors
                        write_slots(page, index, layer[name].to(page.device, non_blocking=True))
    except CacheCapacityError:
        for seq_id in reversed(added):
            cache.free(seq_id)
        raise
    return added


# ----------------------------------------------------------------------------------------------
# files
def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def save(cache, path, seq_ids: list[int]) -> Path:
    """Write sequences `seq_ids` to one safetensors file at `path` (atomically: a temporary file, then a rename)."""
    from safetensors.torch import save as save_bytes

    if not seq_ids:
        raise SnapshotError("save() got no sequence ids: name the sequences to save")
    snaps = [take(cache, s) for s in seq_ids]
    tensors = {f"{i}.{layer}.{name}": t.contiguous()
               for i, snap in enumerate(snaps) for layer, parts in enumerate(snap.layers) for name, t in parts.items()}
    header = {
        "format": FILE_FORMAT,
        "version": str(FILE_VERSION),
        "identity": json.dumps(snaps[0].identity, sort_keys=True),
        "sequences": json.dumps([{"seq_id": s, "num_tokens": snap.num_tokens} for s, snap in zip(seq_ids, snaps)]),
        "checksums": json.dumps({name: _sha256(t) for name, t in tensors.items()}, sort_keys=True),
    }
    path = Path(path)
    data = save_bytes(tensors, metadata=header)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _read_header(data: bytes, path) -> dict:
    if len(data) < 8:
        raise SnapshotError(f"{path} is truncated ({len(data)} bytes): not a pagedkv snapshot file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise SnapshotError(f"{path} is truncated: its header says {n} bytes but the file has {len(data) - 8} after it")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"{path} has a corrupted header ({exc}); the file cannot be loaded") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FILE_FORMAT:
        raise SnapshotError(f"{path} is a safetensors file but not a pagedkv snapshot (no '{FILE_FORMAT}' header)")
    if meta.get("version") != str(FILE_VERSION):
        raise SnapshotError(f"{path} is a pagedkv snapshot of file version {meta.get('version')}, but this pagedkv "
                            f"reads version {FILE_VERSION}; save it again with this version")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != len(data):
        raise SnapshotError(f"{path} is truncated or padded: its tensors end at byte {8 + n + max(ends, default=0)} "
                            f"but the file has {len(data)} bytes")
    return meta


def read(path) -> list[Snapshot]:
    """The snapshots saved in `path`, every tensor checked against its sha256 (raises SnapshotError)."""
    from safetensors.torch import load as load_bytes

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc.strerror or exc}") from None
    meta = _read_header(data, path)
    try:
        tensors = load_bytes(data)
        identity = json.loads(meta["identity"])
        sequences = json.loads(meta["sequences"])
        checksums = json.loads(meta["checksums"])
    except Exception as exc:  # safetensors' own errors, missing or malformed header entries
        raise SnapshotError(f"{path} is corrupted ({type(exc).__name__}: {exc}); it cannot be loaded") from None
    if set(checksums) != set(tensors):
        raise SnapshotError(f"{path} is corrupted: its tensors do not match its checksum list")
    for name, t in tensors.items():
        if _sha256(t) != checksums[name]:
            raise SnapshotError(f"{path} is corrupted: tensor {name!r} fails its sha256 checksum")
    snaps = []
    num_layers = len(identity.get("layers") or [])
    for i, seq in enumerate(sequences):
        layers = [{key.rsplit(".", 1)[1]: t for key, t in tensors.items() if key.startswith(f"{i}.{layer}.")}
                  for layer in range(num_layers)]
        snaps.append(Snapshot(identity, int(seq["num_tokens"]), layers))
    return snaps


def load(cache, path, *, device=None) -> list[int]:
    """Add the sequences saved in `path` to `cache` (all or none); returns their new ids."""
    return restore_many(cache, read(path), device=device)
