"""Tile shapes and the split-K decision, from tensor shapes only (never from per-step lengths).

Decode-like batches (about one query token per sequence) use 16-row tiles: the rows are the query
heads of one KV head's group, and the kernel is bound by reading pages. Prefill uses 128-row tiles
and is bound by the matrix units. Split-K is taken when the (query block, KV head) programs would
not fill the GPU, so that long contexts of few sequences are spread over all multiprocessors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class TileConfig:
    block_m: int      # query rows per program: query tokens x query heads of one group
    tile_n: int       # keys per loop step
    num_warps: int
    num_stages: int


def is_decode_like(num_tokens: int, num_seqs: int) -> bool:
    return num_tokens <= 2 * num_seqs


def choose_tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int, device: torch.device) -> TileConfig:
    rows = max(16, triton.next_power_of_2(group))
    if device.type != "cuda":  # the interpreter: small tiles keep CPU tests quick
        return TileConfig(rows, 16, 4, 1)
    if is_decode_like(num_tokens, num_seqs):
        return TileConfig(rows, 64, 4, 3)
    return TileConfig(max(128, rows), 64 if head_dim <= 128 else 32, 8, 3)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MIN_SPLIT_TOKENS = 256   # keys per split at least, so each split streams enough to hide its latency
MAX_SPLITS = 64


def choose_num_splits(num_programs: int, capacity_tokens: int, device: torch.device) -> int:
    """How many key ranges each (query block, KV head) is split into; 1 means no split-K.

    `capacity_tokens` is the block table's reach (max_blocks * block_size), a shape, not a length.
    """
    if device.type != "cuda":
        return 1
    sms = multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(2 * sms, num_programs), capacity_tokens // MIN_SPLIT_TOKENS)
    return max(1, splits)
