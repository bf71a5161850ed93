"""Tile shapes and the split-K decision, from tensor shapes only (never from per-step lengths).

Decode-like batches (about one query token per sequence) use 16-row tiles: the rows are the query
heads of one KV head's group, and the kernel is bound by reading pages. Prefill uses 128-row tiles
and is bound by the matrix units. Split-K is taken when the (sequence, KV head) programs would not
fill one wave of the GPU, so that long contexts of few sequences are spread over all multiprocessors.
The defaults come from `bench/kernels.py --sweep` on an H200 (BENCHMARKS.md).
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


def choose_tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int, device: torch.device,
                 packed: bool = False) -> TileConfig:
    """`packed`: sub-byte or TurboQuant pages, whose tiles are small enough to stream 128 keys per step."""
    rows = max(16, triton.next_power_of_2(group))
    if device.type != "cuda":  # the interpreter: small tiles keep CPU tests quick
        return TileConfig(rows, 16, 4, 1)
    if is_decode_like(num_tokens, num_seqs):
        return TileConfig(rows, 128 if packed and head_dim <= 128 else 64, 4, 2)
    if head_dim <= 128:
        return TileConfig(max(128, rows), 128, 8, 2)
    return TileConfig(max(64, rows), 64, 4, 2)


def is_packed(kind: str, key_bits: int) -> bool:
    return kind == "turboquant" or (kind == "kvquant" and key_bits < 8)


def split_tiles(group: int, head_dim: int) -> TileConfig:
    """Tiles of the split-K kernel (decode of few, long sequences)."""
    return TileConfig(max(16, triton.next_power_of_2(group)), 128 if head_dim <= 128 else 64, 4, 2)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


CTAS_PER_SM = 3            # resident decode programs per multiprocessor (registers bound it)
MIN_SPLIT_TOKENS = 1024    # keys per split at least, so each split streams long enough to hide latency
MAX_SPLITS = 64


def splits_for(num_programs: int, capacity_tokens: int, num_sms: int) -> int:
    """Key ranges per program: 1 when the programs fill a wave, else enough for about two waves.

    `capacity_tokens` is the block table's reach (max_blocks * block_size), a shape, not a length.
    """
    wave = CTAS_PER_SM * num_sms
    if num_programs >= wave:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(2 * wave, max(num_programs, 1)), capacity_tokens // MIN_SPLIT_TOKENS)
    return max(1, splits)


def choose_num_splits(num_programs: int, capacity_tokens: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return splits_for(num_programs, capacity_tokens, multiprocessor_count(index))
