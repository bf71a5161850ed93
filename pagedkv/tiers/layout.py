"""`BlockLayout`: every layer's page tensors of one block, side by side in one row of bytes.

A block moves between tiers whole: its rows of every layer's page tensors (`[num_kv_heads, block_size,
width]` each as stored, head-major: keys, values and scales) packed into one contiguous uint8 row of `block_bytes`, each part
at an offset aligned to 16 bytes. Copies go in large pieces: one per page tensor for a batch of blocks
(`gather`, `scatter`, on the device), and one device<->host copy per run of consecutive rows (`copy_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.base import stored_blocks

ALIGN = 16


def words(rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows viewed as int64 (rows are multiples of ALIGN bytes): whole-row copies run as wide words,
    where some PyTorch CPU builds copy uint8 one byte at a time (100x slower)."""
    return rows.view(torch.int64)


def runs(dst_index: list[int], src_index: list[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the runs in which `dst_index` and `src_index` both go up by one."""
    out = []
    for d, s in zip(dst_index, src_index):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


def copy_runs(dst: torch.Tensor, dst_index: list[int], src: torch.Tensor, src_index: list[int]) -> None:
    """`dst[dst_index[i]] = src[src_index[i]]` for every i, rows [block_bytes] uint8, one copy per run of
    consecutive rows; between pinned host memory and a device the copies are queued on the current stream."""
    for d, s, n in runs(dst_index, src_index):
        words(dst[d:d + n]).copy_(words(src[s:s + n]), non_blocking=True)


@dataclass(frozen=True)
class _Part:
    layer: int
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # one block as stored: [num_kv_heads, block_size, width]


class BlockLayout:
    def __init__(self, cache):
        parts, offset = [], 0
        for layer, pages in enumerate(cache.pages):
            for name, page in pages.items():
                nbytes = page[0].numel() * page.element_size() if page.shape[0] else \
                    torch.Size(page.shape[1:]).numel() * page.element_size()
                parts.append(_Part(layer, name, offset, nbytes, page.dtype, tuple(stored_blocks(page).shape[1:])))
                offset += -(-nbytes // ALIGN) * ALIGN
        self.parts = parts
        self.block_bytes = offset
        self.device = cache.formats[0].device

    def describe(self) -> list:
        """The layout as plain data (part of the tiers' identity)."""
        return [[p.layer, p.name, p.offset, p.nbytes, str(p.dtype).removeprefix("torch."), list(p.shape)]
                for p in self.parts]

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """`block_ids` as a long tensor on the device, without waiting for the stream (through pinned memory)."""
        if self.device.type != "cuda":
            return torch.tensor(block_ids, dtype=torch.long)
        return torch.tensor(block_ids, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def gather(self, cache, block_ids: list[int]) -> torch.Tensor:
        """Blocks `block_ids` of every layer as rows [len(block_ids), block_bytes] uint8 on the cache's device
        (queued on the current stream on CUDA)."""
        n = len(block_ids)
        ids = self._index(block_ids)
        out = torch.empty(n, self.block_bytes, dtype=torch.uint8, device=self.device)
        for p in self.parts:
            page = stored_blocks(cache.pages[p.layer][p.name])  # [num_blocks, H, block_size, width]
            torch.index_select(page.view(page.shape[0], -1), 0, ids,
                               out=out[:, p.offset:p.offset + p.nbytes].view(p.dtype))
        return out

    def scatter(self, cache, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write `rows` [len(block_ids), block_bytes] uint8 (host or device) into blocks `block_ids` of every layer."""
        n = len(block_ids)
        ids = self._index(block_ids)
        src = words(rows).to(self.device, non_blocking=True).view(torch.uint8)
        for p in self.parts:
            part = src[:, p.offset:p.offset + p.nbytes].view(p.dtype).view(n, *p.shape)
            page = stored_blocks(cache.pages[p.layer][p.name])
            with torch.inference_mode(page.is_inference()):  # pages grown inside a forward are inference tensors
                page.index_copy_(0, ids, part)

