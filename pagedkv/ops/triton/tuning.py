"""Tile shapes and the split-K decision, from tensor shapes only (never from per-step lengths).

Decode-like batches (about one query token per sequence) use 16-row tiles: the rows are the query
heads of one KV head's group, and the kernel is bound by reading pages. Prefill uses 128-row tiles
and is bound by the matrix units. Decode is split (split-K) when the (sequence, KV head) programs would
leave multiprocessors idle: long contexts of few sequences are spread over all of them, and a batch is
split so that its last wave is not mostly empty (`splits_for`). Prefill is never split.

Decode tiles are the fastest measured on an H200 (`python bench/kernel_bench.py --sweep`, BENCHMARKS.md). With 2
stages Triton's pipeliner gives each page tile a single shared-memory buffer (the TTGIR for sm_90 shows
it: `bench/kernel_report.py`), so a program has nothing in flight while it computes; double-buffered dense
tiles (5 stages) compile to more registers, fewer resident programs, and measured 25% slower. The
overlap comes from several resident programs per multiprocessor instead.

Split-K is also a cure for wave quantization: 512 programs of q8 pages, three resident per multiprocessor,
run as one full wave and one a third full; split in three they make four nearly full waves of shorter
programs (measured: 1.6x faster at batch 64, 8,192 tokens).
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


# Prefill over quantized pages through dense scratch pages (`dense_prefill.py`: the context dequantized once,
# then the dense kernel) instead of the fused kernels, which convert a context tile once per query block that
# reads it. Measured on an H200 (2,048-token chunk after 8,192 tokens, Llama-3-8B heads, `python
# bench/kernel_bench.py --fused-prefill`): 1.00 ms for KV-Quant and 1.05 for TurboQuant against 1.68-2.71 ms fused
# (`off`: 0.98). False: the fused kernels everywhere (`dense_prefill.step_of` checks it).
DENSE_PREFILL = True


# Keys a step of the varlen and split-K kernels for float32 queries. Their products are IEEE float32 on the CUDA
# cores (`attention.dot_precision`), operands held in registers: compiled for sm_90 at head_dim 128, 128 keys x 128
# query rows spill 20-26 KB a thread, and the local memory that reserves for every resident thread ran an H100 out
# of memory at launch (TurboQuant prefill through dense scratch, 16 test processes on the GPU); with 32 keys and at
# most 32 rows the stack stays under 1.3 KB over the pages, 2.9 KB with TurboQuant's rotations in registers (dense
# scratch), split-K's 16 rows under 0.4 KB (`bench/kernel_report.py --compile-all --dtypes float32 --stack-limit`).
# Only correctness is asked of float32 on a GPU (serving runs in bfloat16 / float16, on the Gluon kernels).
FLOAT32_TILE_N = 32


def choose_tiles(num_tokens: int, num_seqs: int, group: int, head_dim: int, device: torch.device,
                 pages: str = "dense", dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """`pages`: `page_class` of the format; `dtype`: the queries'."""
    rows = max(16, triton.next_power_of_2(group))
    if device.type != "cuda":  # the interpreter: small tiles keep CPU tests quick
        return TileConfig(rows, 16, 4, 1)
    if is_decode_like(num_tokens, num_seqs):
        return decode_tiles(rows, head_dim, pages, dtype)
    if dtype == torch.float32:
        return TileConfig(max(32, rows), FLOAT32_TILE_N, 8, 2)
    if head_dim <= 128:
        return TileConfig(max(128, rows), 128, 8, 2)
    return TileConfig(max(64, rows), 64, 4, 2)


def page_class(fmt) -> str:
    """"dense" (float pages), "int8" (KV-Quant q8) or "packed" (sub-byte codes, TurboQuant) for a PageFormat."""
    kind = fmt.spec.kind
    if kind == "dense":
        return "dense"
    return "int8" if kind == "kvquant" and fmt.bits == 8 else "packed"


def decode_tiles(rows: int, head_dim: int, pages: str, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """Dense and int8 pages: 64 keys per step; packed pages: 128 keys; 4 warps, 2 stages. head_dim 256:
    64 keys, so that two programs still fit a multiprocessor's shared memory. float32 queries: FLOAT32_TILE_N."""
    if dtype == torch.float32:
        return TileConfig(rows, FLOAT32_TILE_N, 4, 2)
    if head_dim > 128:
        return TileConfig(rows, 64, 4, 2)
    return TileConfig(rows, 128 if pages == "packed" else 64, 4, 2)


def split_tiles(group: int, head_dim: int, pages: str = "dense", num_splits: int = 2,
                dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """Tiles of the split-K kernel: the decode tiles, except that quantized pages, and dense pages split
    more than 4 ways (few programs, each streaming one long range), read 128 keys per step (measured on an
    H200 at batch 1, 32,768 tokens, 32 splits: 49.8 us against 57.5 with 64 keys; at batch 32, 4,096 tokens,
    2 splits, 64 keys stay faster: 132 against 138 us)."""
    tiles = decode_tiles(max(16, triton.next_power_of_2(group)), head_dim, pages, dtype)
    if head_dim <= 128 and (pages != "dense" or num_splits > 4) and dtype != torch.float32:
        tiles = TileConfig(tiles.block_m, 128, 4, 2)
    return tiles


def smaller_tiles(tiles: TileConfig, min_rows: int) -> TileConfig | None:
    """The next config down when `tiles` needs more shared memory than a GPU has (GPUs with about 100 KB per
    block, like the RTX 4090, L4 or A10, against 227 KB on an H100/H200): first fewer pipeline stages, then
    fewer keys per step, then fewer query rows; None when nothing smaller is left."""
    if tiles.num_stages > 2:
        return TileConfig(tiles.block_m, tiles.tile_n, tiles.num_warps, 2)
    if tiles.tile_n > 16:
        return TileConfig(tiles.block_m, tiles.tile_n // 2, tiles.num_warps, tiles.num_stages)
    if tiles.block_m // 2 >= min_rows:
        return TileConfig(tiles.block_m // 2, tiles.tile_n, max(4, tiles.num_warps // 2), tiles.num_stages)
    return None


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory_per_program(device_index: int) -> int:
    """The most shared memory one program may take on this GPU (opt-in), bytes: 227 KB on an H100 / H200, 99 KB
    on sm_89."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


# Resident dense-page decode programs per multiprocessor (registers bound them: 119 per thread at 4 warps on
# sm_90, `bench/kernel_report.py`), at head_dim <= 128 and at head_dim 256 ("wide").
CTAS_PER_SM = {"dense": 4, "wide": 2}
# Quantized pages are decoded by arithmetic, and their programs take unequal times; rather than a count of
# full waves they need at least this many programs per multiprocessor (measured on an H200 over 1-4 splits
# at batch 32, 64 and 128: `python bench/kernel_bench.py --sweep`, BENCHMARKS.md).
QUANTIZED_PROGRAMS_PER_SM = 8
MIN_SPLIT_TOKENS = 1024    # keys per split at least, so each split streams long enough to hide latency
MAX_SPLITS = 64
SPLIT_COST = 0.05          # a split's extra cost (partial outputs, the reduce), relative to its share of the work


def splits_for(num_programs: int, capacity_tokens: int, num_sms: int, ctas_per_sm: int = 3,
               min_programs_per_sm: int = 0) -> int:
    """Key ranges per program. With `min_programs_per_sm` (quantized pages): the fewest splits that give
    at least that many programs per multiprocessor. Otherwise (dense pages) the fewest (nearly) full
    waves: the split count s minimising ceil(num_programs * s / wave) / s, the time in units of one
    unsplit program, plus SPLIT_COST per extra split. Either way an underfilled GPU (few long sequences)
    is spread over every multiprocessor, and a batch that overflows one wave by a little is split so
    that its last wave is not mostly idle. At most capacity_tokens / MIN_SPLIT_TOKENS splits.

    `capacity_tokens` is the block table's reach (max_blocks * block_size), a shape, not a length.
    """
    limit = max(1, min(MAX_SPLITS, capacity_tokens // MIN_SPLIT_TOKENS))
    if min_programs_per_sm:
        return max(1, min(limit, -(-min_programs_per_sm * num_sms // max(num_programs, 1))))
    wave = ctas_per_sm * num_sms
    best, best_cost = 1, float("inf")
    for s in range(1, limit + 1):
        cost = -(-num_programs * s // wave) / s * (1 + SPLIT_COST * (s > 1))
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def choose_num_splits(num_programs: int, capacity_tokens: int, device: torch.device, pages: str = "dense",
                      head_dim: int = 128) -> int:
    if device.type != "cuda":
        return 1
    num_sms = multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    if pages != "dense":
        return splits_for(num_programs, capacity_tokens, num_sms, min_programs_per_sm=QUANTIZED_PROGRAMS_PER_SM)
    return splits_for(num_programs, capacity_tokens, num_sms, CTAS_PER_SM["wide" if head_dim > 128 else "dense"])


WARP_SPLIT_MIN_TOKENS = 128   # keys per split of the warp-split decode kernel, at least
WARP_SPLIT_MAX_SPLITS = 256


# With a longest-first launch order (`metadata.LONGEST_FIRST`), at least this many programs per resident slot: more
# programs than slots, so those of the longest sequences start first and the shorter ones fill in behind them
# (modelled: 1,024-2,048-token sequences at batch 128 end 1.39x after an even split of the work in grid order with
# one split, 1.11x with two splits longest first; measured on an H200, ragged batches 7-17% faster than grid order
# at the best split, `SPREAD=0.5 bench/gluon_probe.py`).
ORDERED_MIN_WAVES = 1.5
# ... but not just past the programs a multiprocessor holds at once (its resident programs, by registers): a split
# count whose programs come to more than one full wave and at most this many leaves a short second wave of the
# longest sequences' programs, run at a fraction of the occupancy, so it takes one split more. q4 at 1,536 tokens,
# batch 144 (2 splits: 1.09 waves of 16 one-warp programs a multiprocessor) against 3 splits (1.64), us: H100 115
# against 101, lengths spread +-50% 97.8 against 87.3; H200 (session 33) 88.4 against 81.6; batch 152 on the H100
# 118 / 106, spread 101 / 90.4; at batch 128 (2 splits: exactly one wave) 2 stay faster than 3 (86.8 / 92.4). One
# split, where the ordered rule does not apply, was faster still on the H100 (93.6 / 74.9 spread) but not on the
# H200 (84.9). BENCHMARKS.md, session 38.
ORDERED_TAIL_WAVES = 1.25


def warp_split_splits(num_programs: int, capacity_tokens: int, device: torch.device, programs_per_sm: int = 16,
                      ordered: bool = False, resident_per_sm: int | None = None) -> int:
    """Key ranges per program of the warp-split decode kernel (`decode.py`): none while the (query token, KV
    head) programs fill more than half of the resident slots (`programs_per_sm` per multiprocessor), else as
    many as fill them. Measured on an H200 with one-warp programs, 16 per SM (`bench/kernel_bench.py --warp-split`,
    2026-12-01): at every shape the best split count is the one that makes about 2,048 programs (batch 128 at
    2,048 tokens: 2; batch 64 at 8,192: 4; batch 32 at 4,096: 8; batch 1 at 32,768: 256; TurboQuant at batch 64:
    512 us against 820 with half as many). Longest first (`ordered`), past one wave of `programs_per_sm`
    (ORDERED_MIN_WAVES), and where the kernel's resident programs a multiprocessor are known (`resident_per_sm`),
    not into a short second wave of them (ORDERED_TAIL_WAVES)."""
    if device.type != "cuda":
        return 1
    num_sms = multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    slots = programs_per_sm * num_sms
    limit = max(1, min(WARP_SPLIT_MAX_SPLITS, capacity_tokens // WARP_SPLIT_MIN_TOKENS))
    if 2 * num_programs > slots:   # one split, unless longest first: then past one wave (ORDERED_MIN_WAVES)
        if not ordered:
            return 1
        splits = max(1, min(limit, -(-int(ORDERED_MIN_WAVES * slots) // num_programs)))
        resident = (resident_per_sm or 0) * num_sms
        if resident < splits * num_programs <= ORDERED_TAIL_WAVES * resident and splits < limit:
            splits += 1
        return splits
    return max(1, min(limit, slots // max(num_programs, 1)))


@dataclass(frozen=True)
class DecodeTiles:
    """A warp-split decode kernel config (`decode.py`): keys per warp per step, warps, pipeline stages, the
    orientation (`transposed`: keys on the matrix units' M dimension, `decode_transposed.py`) and a register
    cap per thread (None: the compiler's choice), and how many programs then fit a multiprocessor (registers
    bound them: `bench/kernel_report.py`)."""
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    transposed: bool = False
    max_registers: int | None = None
    programs_per_sm: int = 2


def warp_split_tiles(fmt) -> DecodeTiles:
    """The warp-split decode kernel's config per format, the fastest measured on an H200 over batch 1-128
    (`bench/kernel_bench.py --warp-split`, BENCHMARKS.md): transposed, unpipelined (1 stage), one warp per program,
    capped at 128 registers so that 16 programs fit a multiprocessor; 16 keys per step for TurboQuant, 32 for
    KV-Quant.

    One warp per program (2026-12-01, late), against four that share a program's keys: the layout conversions
    through shared memory (P^T, the codes) synchronise a program's warps 12-18 times per step, so four warps
    wait for the slowest of them; one-warp programs run independently. Split to fill the slots
    (`warp_split_splits`): TurboQuant 1.10-1.16x, q4 1.08-1.17x, q6 1.10-1.11x, q8 1.00-1.16x faster. Two warps
    per program lie in between. Before that (four warps): Triton's pipeliner gave each page tile one shared-memory
    buffer, which only delayed the loop (so 1 stage); lower register caps spill and measured 1.1-1.4x slower;
    prefetching the next step's pages into registers, 1.3-2x slower, and its block ids alone, no faster."""
    if fmt.spec.kind == "turboquant":
        return DecodeTiles(16, 1, 1, transposed=True, max_registers=128, programs_per_sm=16)
    return DecodeTiles(32, 1, 1, transposed=True, max_registers=128, programs_per_sm=16)


def plan_attention(num_tokens: int, num_seqs: int, group: int, head_dim: int, fmt, capacity_tokens: int,
                   device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[int, TileConfig]:
    """(num_splits, tiles) of one attention call: for decode-like batches, split-K (with its own tiles)
    when the (sequence, KV head) programs would leave the GPU partly idle (`splits_for`); else the
    varlen kernel's tiles. Prefill is never split: the split kernel's 16-row tiles would read every key
    once per 16 query rows instead of once per 128 (measured on an H200: a 2,048-token dense chunk 2.7x
    slower, TurboQuant prefill slower still, as its keys are decoded on every read)."""
    pages = page_class(fmt)
    tiles = choose_tiles(num_tokens, num_seqs, group, head_dim, device, pages=pages, dtype=dtype)
    if not is_decode_like(num_tokens, num_seqs):
        return 1, tiles
    num_splits = choose_num_splits(num_seqs * fmt.num_kv_heads, capacity_tokens, device, pages, head_dim)
    if num_splits > 1:
        tiles = split_tiles(group, head_dim, pages, num_splits, dtype)
    return num_splits, tiles


WINDOW_MAX_NEW_TOKENS = 16   # new tokens per sequence the decode kernel reads a window for: verify steps of 15 drafts


_fitted: dict[tuple, object] = {}   # (kernel, device, dtype, format, head_dim, chosen tiles) -> tiles that fit


def launch_fitting(launch, tiles, group: int, key: tuple):
    """launch(tiles), stepping down to smaller tiles (`tuning.smaller_tiles`) while the GPU's shared memory
    is too small for them; what fits is remembered per device and config, so later calls (and CUDA-graph
    captures after a first eager call) launch it directly."""
    import warnings

    from triton.runtime.errors import OutOfResources

    key = (*key, tiles)
    fitted = _fitted.get(key, tiles)
    while True:
        try:
            out = launch(fitted)
        except OutOfResources as exc:
            smaller = smaller_tiles(fitted, max(16, group))
            if smaller is None:
                raise
            if key not in _fitted:
                warnings.warn(f"pagedkv: {key[0]} attention tiles {tiles} need more than this GPU has ({exc}); "
                              "using smaller tiles", RuntimeWarning, stacklevel=3)
            _fitted[key] = fitted = smaller
            continue
        _fitted.setdefault(key, fitted)
        return out
