"""Decode attention over quantized pages in Gluon: every page byte streamed through a ring in shared memory by
cp.async and read back straight into the matrix-unit operand registers of the lane that uses it.

The transposed kernel (`decode_transposed.py`) is written in Triton's tile language, which picks register
layouts itself: each load lands in a plain row layout and a layout conversion through shared memory (a store,
a barrier, a load) follows it before the matrix instruction, three to four per step, one after another.
Gluon states layouts explicitly, and the order of channels and keys inside one step is free (a dot product
does not depend on it): so each lane reads whole runs of a key row and the kernel *names* the channels of
those bytes so that they are exactly the lane's operand elements of `mma.sync` m16n8k16 (a reshape and
permute of the loaded tensor: register renaming, checked by `convert_layout(..., assert_trivial=True)`). The
query is loaded once in the same channel order, and the output stored back through the inverse order.

Shared memory is the one path every byte takes twice, so neither side may waste it: the copies ask for 16-byte
runs (each lane its own, none asked twice), and the rings are laid out so that the rows one read takes at once lie
in different banks (XOR-swizzled key rows, a linear layout for the 4-bit value words). Nsight Compute measured
4.3x the ideal shared-memory traffic in the TurboQuant kernel before (`bash bench/h200_run.sh ncu-source`,
`bench/ncu_summary.py`; BENCHMARKS.md, 2026-12-03).

S^T = K Q^T puts keys on the M dimension and the group's query heads on N (8 columns); its accumulator
fragment holds P^T with keys on the lane's row bits, while O^T = V^T P^T needs them on its column bits: one
`movmatrix.trans` per 8 x 8 block transposes it across the warp in registers (two per step). The copies of
step i + 1 are in flight while step i computes (`STAGES`), holding no register.

One warp per program, programs over (query token, KV head, split) like the other decode kernels (dense pages: four
KV heads a program by default, a warp each, `decode_dense_kernel`); partial states in
`split_k.partial_states`' layout. Four kernels: q8 (head_dim 64 and 128), q4 and q6 (one kernel, head_dim
128), TurboQuant (q8_0 or q4_0 keys, q3_0 or q4_0 values; head_dim 128), dense pages (`off`, 64 and 128: `ldmatrix`
from the ring, nothing to convert), none with soft-capping or a sliding window. With a dense recent window (q8, q4,
q6, TurboQuant) the page splits stop where each sequence's window begins and the window is one more split
(`window_splits`).
`launcher` serves a decode batch with one where its format is in DEFAULT_KERNELS, each measured faster than
`decode.py` (for `off`, the varlen / split-K kernels) on an H200 at every shape (`bash bench/h200_run.sh gluon`,
2026-12-02). Gluon has no interpreter: on the CPU they are compiled
for sm_90 (`bench/kernel_report.py --gluon`) and their PTX look-ups run in an emulator; on the GPU they are
checked against the reference path (`tests/triton/test_decode_gluon.py`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .conversions import (CODE_NIBBLES_ASM, CODE_NIBBLES_TABLE_ASM, INT8_ASM, INT8_OFFSET_ASM, NIBBLE_KEY_PAIRS_ASM,
                          NIBBLE_OFFSET_ASM, SIGN_NIBBLES_KEY_PAIRS_ASM, SIGNED_NIBBLE_SPREAD_ASM, SIX_BIT_KEY_PAIRS_ASM,
                          SIX_BIT_SPREAD_ASM)
from .decode_io import launch_grid, program_coords

LOG2E = gl.constexpr(1.4426950408889634)
# steps of the shared ring in flight per program. Measured on an H200 (`bench/gluon_probe.py`, 2026-12-02): 2
# stages 1.0-1.1x faster than 3 or 4 (less shared memory, more programs resident); the next step's codes held in
# registers instead (168 registers, 12 programs per multiprocessor) 1.2-1.3x slower than the ring
STAGES = 2
# resident programs per multiprocessor the split count aims at (`tuning.warp_split_splits`). Measured on an H200
# (`bench/gluon_probe.py`, 2026-12-02): 8 made the best split count, or within 3% of it, at every shape timed for
# q8, q4, `off` and TurboQuant K q4_0 / V q4_0 (batch 1 at 32,768 tokens: 128; 32 at 4,096: 4; 64 at 8,192: 2; 128
# at 2,048: 1); see TQ_TUNING for K q8_0 / V q3_0
PROGRAMS_PER_SM = 8
# TurboQuant (key, value) quantizers -> (registers per lane capped at, programs per multiprocessor). Measured on an
# H200 (`bench/gluon_probe.py`, 2026-12-02): K q8_0 / V q3_0 then used 151 registers uncapped (12 programs fit a
# multiprocessor); capped at 128 (no spills) with twice the splits it is 1.07-1.12x faster than `decode.py`
# (batch 64 at 8,192 tokens: 383 us at 4 splits against 429 at 2). Today's kernel compiles to 128 registers uncapped
# too (session 37), and times the same either way on an H100. K q4_0 / V q4_0 runs uncapped (capped at 128:
# 1.07-1.53x slower); its 162-165 registers hold 12 programs a multiprocessor, so its splits aim at 12: in one run of
# `bench/kernel_bench.py` on an H100 (2026-12-06) against 16, whose second wave of programs ran as a tail, 1.09-1.15x
# faster at (32, 4096), (64, 8192) and (128, 2048) (67.2 / 237.3 / 130.2 against 77.2 / 259.8 / 138.5 us), the same
# at one sequence; 8 was faster still at (32, 4096) (64.7) but 1.11x slower than 12 at (128, 2048).
TQ_TUNING = {("q8_0", "q3_0"): (128, 16), ("q4_0", "q4_0"): (None, 12)}
# The kernels that read 32 keys a loop step (PAIRS) by default: the q4 / q6 kernel for these bits per code, the
# TurboQuant kernel for these (key, value) quantizers. Timed on an H200 with head-major pages (`bench/gluon_probe.py`, 2026-12-02):
# q4 1.05-1.13x faster than 16 keys a step at every shape, K q4_0 / V q4_0 1.00-1.04x; K q8_0 / V q3_0 within 1%
# either way; q6 slower with slot-major pages (as was q4 at 8,192 tokens and more), not timed head-major.
Q4_PAIRS_BITS = (4,)
TQ_PAIRS = (("q4_0", "q4_0"),)
# K q8_0 / V q3_0 loop instructions a 16-key step on sm_90: TQ_HALVES widens the scale columns from half registers of
# their words, no shifts (`column`): 556 -> 544 at 128 registers. Timed on an H100 (`bash bench/h200_run.sh tq-lean`,
# 2026-12-07), bound by its reads: within 1% of the kernel before everywhere, its work-only probe 1.016-1.024x faster at
# the served 2 splits at batches 112 / 100 x 1,536, the same-memory run the same (23,205 against 23,223 output tokens/s,
# two runs each); so it is on, to be timed on an H200, where the work is nearer the bound. TQ_TABLES holds the 3-bit
# codebook's byte tables in registers (`code_tables`) where the assembler moved an immediate into a register before each
# look-up: 516 at 128 registers (500 with 32-bit page offsets), uncapped 509 at 141. Off until timed on an H200 (on an
# H100, before the tables were lane-varying, 543 at 128: the same time as TQ_HALVES; uncapped no faster)
TQ_TABLES = False
TQ_HALVES = True
# TQ_ROWS: the pages' slot strides taken as their rows' sizes where they are (`head_major`, as `empty_pages` lays them
# out), constants, so that each lane's copies are one address and immediate offsets: 544 -> 536 loop instructions
# (with TQ_TABLES and 32-bit page offsets 500 -> 490; the tables uncapped then fit 128 registers too). Off until timed
TQ_ROWS = False
# TQ_SKEW (TurboQuant, 16-key steps): the loop software-pipelined by hand, each step the scores and softmax of its own
# keys beside the value products of the step before (`tq_skewed_loop`), two chains with no dependence between them
# that the assembler can interleave, where a step's chain (products, maximum across lanes, exponentials, conversions,
# value products) runs alone today: the kernel is bound by its warps' latency (3 of 16 warps a scheduler at the
# same-memory run's batch). One more ring stage holds the values a step behind. Off until timed
TQ_SKEW = False
# Q4_SKEW (q4 in 32-key steps, q6 where asked for them): the same for `decode_q4_kernel` (`q4_skewed_pairs`; a ring of
# 6 stages for 4, 13,056 B a program; capped at 128 registers, 603 loop instructions a 32-key step for 587). Off until
# timed
Q4_SKEW = False
# LANE_SUMS (TurboQuant, q4, q6): the softmax sums kept in the lanes and added up across them once after the loop
# (`softmax_step`'s LANES), not every step: TurboQuant 544 -> 532 loop instructions a 16-key step. On since
# 2026-12-07, timed on an H100 (`bash bench/h200_run.sh lean-pick` and `tq-lean`, longest first, against the kernel
# before timed twice): TurboQuant within 0.6% at every probe shape (bound by its reads there) and its work-only probe
# 1.05-1.08x faster; q6 1.014-1.023x faster at (144, 1536), (112, 1536), (64, 8192), within 1% elsewhere; q4 within
# 0.5%. The GPU tests `variants_match` check it against the kernel without
LANE_SUMS = True
# q4 keys left over their float16 offsets (`NIBBLE_OFFSET_ASM`, as TurboQuant's q4_0 keys), the offsets and the codes'
# + 7 taken off once per program as the start of the products (`q4_offset_start`): four fewer instructions every
# eight key codes. On since 2026-12-07: on an H100, bound by q4's reads, 1.012-1.022x faster at the same-memory run's
# batch (144, 1536), three runs (with LANE_SUMS: `bash bench/h200_run.sh lean-pick`, `tq-lean`), within 1% of the
# kernel before at every other shape and in the same-memory run (31,798 against 31,736 output tokens/s, two runs
# each); the q4 GPU decode, window and CUDA graph tests pass with it on
Q4_OFFSET_KEYS = True
# The formats whose decode batches with a dense recent window run the Gluon kernels (their page splits, then the
# window as one more split, `window_splits`) from WINDOW_MIN_TOKENS query tokens on; the others, and smaller
# batches, run `decode.py`, which reads the window in the same kernel. Timed side by side on an H200 (2026-12-02,
# window of 128, `python bench/kernel_bench.py --recent-tokens 128 --gluon-window` serves every format this way): q6
# 1.10-1.27x and TurboQuant 1.07-1.13x faster at (32, 4096) and (64, 8192), q6 1.22x and TurboQuant 0.99x at
# (128, 2048); q8 and q4 0.95-1.03x; at one sequence every format 0.77-0.92x (the window's own kernel runs
# after the pages', its latency not hidden). Again for q4 after its 32-key steps (session 16, same command): 1.04x
# at (32, 4096), 1.09x at (64, 8192), 1.11x at (128, 2048), 0.81x at one sequence.
WINDOW_KERNELS = ("q4", "q6", "turboquant")
WINDOW_MIN_TOKENS = 32
# KV heads a program of the dense (`off`) decode reads where they divide the heads (`dense_heads`), a warp each.
# Timed on an H200 (`bench/gluon_probe.py`, 2026-12-04, BENCHMARKS.md session 26) against one head a program: 4
# heads 1.01-1.015x faster at (32, 4096), (64, 8192), (128, 2048) and (32, 16384), the same at (8, 16384) and one
# sequence of 32,768 tokens (128 splits: 36.9 against 36.8 us); 8 heads within 0.5% of 4 but slower at one sequence
# (38.0 against 36.6 us; 128 KB of shared memory a program); 2 no faster
DENSE_HEADS = 4
# The dense decode's block ids a step ahead (`decode_dense_kernel`'s IDS_AHEAD): each loop step loads the block id of
# the next step's copy, so that no copy waits on a block-table load (218 loop instructions against 215, 118-120
# registers against 120-123, no spills). Timed on an H100 only (2026-12-06, BENCHMARKS.md session 39,
# `bench/gluon_probe.py`, two runs, against the kernel as served before and after it): 0.2-1.0% faster at
# (1, 32768), (64, 8192) and (128, 2048), the same at (32, 4096). Off until an H200 times it (`OUT=$OUT bash
# bench/h200_run.sh off-ids`).
DENSE_IDS_AHEAD = False
# The dense decode's splits inside a program (`decode_dense_kernel`'s INNER, `dense_plan`): where the split rule asks
# for s > 1 key ranges, a program's warps read min(s, DENSE_INNER_MAX) of them (rounded up to a power of two) and
# merge in shared memory, so that up to DENSE_INNER_MAX splits need no reduce kernel after the page kernel. A program
# is four warps (the served kernel's before: as many programs, as many resident), or eight (twice the heads, one
# resident a multiprocessor at head_dim 128) where those fill their last wave of multiprocessors at least
# DENSE_WAVE_FILL full. Timed on an H100 (2026-12-06, BENCHMARKS.md session 40, `bash bench/h200_run.sh off-inner`,
# two runs), us, splits across programs as served before / eight warps / four warps (SDPA): (32, 4096) 177 / 174 /
# 174 (172), (64, 8192) 679 / 675 / 676-677 (675), (128, 2048) 353 / 343-344 / 348 (343), one sequence of 32,768
# tokens 50.0-50.2 / 49.2-49.4 / 48.9-49.1 at 32 x 4 splits (50.0). Served through the kernel table on another
# H100 (session 41), time / SDPA across -> plan: (1, 32768) 1.016 -> 1.000, (32, 4096) 1.027 -> 1.012, (64, 8192)
# 1.013 -> 1.006, (128, 2048) 1.039 -> 1.009; the same-memory run's `off` 0.5% faster. On an H200 (session 42,
# `bash bench/h200_run.sh h200-inner`, then two more runs of each alternating), time / SDPA across -> plan:
# (1, 32768) 0.991-1.000 -> 0.981-0.986, (32, 4096) 1.018-1.020 -> 1.003-1.011, (64, 8192) 1.006-1.008 ->
# 0.996-1.000, (128, 2048) 1.064-1.070 -> 1.009-1.013; the same-memory run's `off` 15,075 -> 15,098 tokens/s.
# Served since; False: splits across programs (`paged_attention_dense(plan=False)`)
DENSE_INNER = True
DENSE_INNER_MAX = 4
DENSE_WAVE_FILL = 0.9
# One-warp programs of a Gluon decode kernel a multiprocessor holds at once, by their registers a lane, for head_dim
# 128: the register file is four partitions of 16,384, one a scheduler, and a warp's registers lie in one, so
# 4 x (16,384 // (32 x registers in steps of 8)) -- not 65,536 // (32 x registers): Nsight Compute's block limit
# for TurboQuant capped at 104 registers is 16, at 96 it is 20 (BENCHMARKS.md, session 38). Registers as compiled
# for sm_90 (`bench/kernel_report.py --gluon`): q8 128, q6 123, q4 114, TurboQuant 128, K q4_0 / V q4_0 162-165;
# tests/triton/test_sm90_compile.py checks the table against them. The split rule uses it to keep longest-first
# launches out of a short second wave (`tuning.ORDERED_TAIL_WAVES`).
RESIDENT_PROGRAMS = {"q8": 16, "q6": 16, "q4": 16, ("q8_0", "q3_0"): 16, ("q4_0", "q4_0"): 12}
# split counts at most: a batch of one 32,768-token sequence split 256 ways took 1.0-1.1x the time of 128 ways
# for every TurboQuant kernel (the policy's 16 programs per multiprocessor would ask for 256)
MAX_SPLITS = 128

# Timing probes of the TurboQuant kernel (`paged_attention_tq(probe=...)`, `bench/gluon_probe.py`), each in place of
# attention: "copies", the ring's copies and waits without a step's work (the page reads alone); "codes", the same
# without the scale rows; "work", a step's work on whatever the ring holds, without copies or waits
PROBE_COPIES, PROBE_CODES, PROBE_WORK = gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
PROBES = {"copies": 1, "codes": 2, "work": 3}

# Page offsets in 32 bits: a block's offset (block id x block stride) computed in int32 instead of int64, where every
# page tensor has fewer than 2^31 elements (`offsets_in_32_bits`). Compiled for sm_90 (bench/kernel_report.py
# --gluon, bfloat16, 4 splits, longest first), the key loop's SASS instructions, int64 -> int32: q8 435 -> 415
# (head_dim 64: 305 -> 291), q4 659 -> 633, q6 539 -> 521, TurboQuant K q8_0 / V q3_0 556 -> 539, K q4_0 / V q4_0
# 1,031 -> 1,002, `off` 215 -> 206; no more registers (q4_0 / q4_0 160 -> 163, 12 programs a multiprocessor
# either way). Timed on an H100 (2026-12-06, `bash bench/h200_run.sh offsets32`, longest first at five shapes): no
# faster -- every kernel within 1% of int64 at most shapes, q6 and q4 up to 2% slower at (128, 2048), K q4_0 / V q4_0
# 0.5-1.7% faster; the kernels are bound by issue, not by the few instructions saved. Off (not timed on an H200).
OFFSETS32 = False
INT32_ELEMENTS = 2**31


MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(0, MMA.value, 2))
B_OP = gl.constexpr(gl.DotOperandLayout(1, MMA.value, 2))
PLAIN = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [1, 1], [1, 0]))
# The copies ask for 16-byte runs (8 for the 3-bit values' N bytes), every lane its own: [16 keys, row bytes]
# as the 32 lanes tile it, so no run is asked for twice and a warp's writes to the ring fill whole wavefronts.
COPY_ROWS = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0]))    # q8_0 key codes, 128-byte rows
Q4_KEYS = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [1, 1], [1, 0]))      # 4-bit key codes, 64-byte rows
COPY_WORDS = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))    # 4-bit value words, 64-byte rows
COPY_UNITS = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0]))   # 3-bit values: M words, N bytes
# Key rings: 16-byte units XOR the row (128-byte rows: row % 8; 64-byte rows, two to a bank line: row // 2 % 4),
# so the eight rows an operand read takes at once lie in different banks.
KEY_RING = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
HALF_KEY_RING = gl.constexpr(gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
# The 4-bit value words' ring ([stages, 16 keys, 16 words]): a key's 64-byte row stays whole, and key bit 1 picks
# the bank half, so the four keys 2q + c (q = 0..3) a `TQ_UNITS` read takes at once fill both halves.
WORD_RING = gl.constexpr(gl.SharedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8], [2, 0], [1, 0], [4, 0], [8, 0]]))


def key_load_layout(head_dim: int) -> gl.BlockedLayout:
    """Key rows [16 keys, head_dim bytes] as loaded: lane (g = lane // 4, q = lane % 4) holds keys g and g + 8,
    bytes head_dim / 4 * q .. + head_dim / 4."""
    return gl.BlockedLayout([1, head_dim // 4], [8, 4], [1, 1], [1, 0])


def value_load_layout(head_dim: int) -> gl.DistributedLinearLayout:
    """Value rows [16 keys, head_dim bytes] as loaded: lane (g, q) holds keys 2q, 2q + 1, 2q + 8, 2q + 9, bytes
    head_dim / 8 * g .. + head_dim / 8 (the keys and channels of its V^T operand fragment)."""
    run = head_dim // 8
    regs = [[0, 1 << i] for i in range(run.bit_length() - 1)] + [[1, 0], [8, 0]]
    lanes = [[2, 0], [4, 0], [0, run], [0, 2 * run], [0, 4 * run]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[16, head_dim])


@gluon.jit
def key_channel(c, HEAD_DIM: gl.constexpr):
    """The stored channel of key operand column c: column 16j + 8a + 2q + b (the m16n8k16 A fragment of lane
    q's quad) is byte HEAD_DIM / 4 * q + 4j + 2a + b, so a lane's columns are one run of bytes."""
    return HEAD_DIM // 4 * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1) + (c & 1)


@gluon.jit
def value_channel(c, HEAD_DIM: gl.constexpr):
    """The stored channel of value operand row c: row 16i + 8a + g (lane g's rows of the V^T fragment) is
    byte HEAD_DIM / 8 * g + 2i + a."""
    return HEAD_DIM // 8 * (c & 7) + 2 * (c >> 4) + ((c >> 3) & 1)


def offsets_in_32_bits(asked: bool | None, view) -> bool:
    """Whether a decode computes its page offsets in int32: as asked (None: OFFSETS32) and only where every page
    tensor of `view` has fewer than 2^31 elements, so that no offset inside one overflows."""
    asked = OFFSETS32 if asked is None else asked
    tensors = (view.k, view.v, view.k_scale, view.k_zero, view.v_scale)   # stand-ins are `view.k` itself
    return bool(asked) and all(t.numel() < INT32_ELEMENTS for t in tensors)


@gluon.jit
def block_of(bt_row, start, kv_hi, BLOCK_SIZE: gl.constexpr, OFFSETS32: gl.constexpr):
    """The page block of key `start` from the sequence's block table row (0 at or past kv_hi), int32 where the
    pages' offsets fit in 32 bits (OFFSETS32), else int64."""
    block = gl.load(bt_row + start // BLOCK_SIZE, mask=start < kv_hi, other=0)
    if not OFFSETS32:
        block = block.to(gl.int64)
    return block


@gluon.jit
def launch_dependents(PDL: gl.constexpr):
    """With PDL: let the kernel launched after this one (the window's or the split reduce, `split_k.dependent_launch`)
    start its programs as this kernel's last ones run (griddepcontrol.launch_dependents, at each program's start)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def int8_to_f16(c):
    """int8 codes -> float16, exact (four per call, `conversions.INT8_ASM`)."""
    return gl.inline_asm_elementwise(INT8_ASM, "=r,=r,r", [c], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def movmatrix_trans(p):
    """`movmatrix.trans` on every 8 x 8 block of a 16-bit accumulator fragment (registers unnamed yet)."""
    return gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p],
                                     dtype=p.dtype, is_pure=True, pack=2)


@gluon.jit
def transpose_p(p):
    """P^T [16 keys, 8 heads] in the accumulator fragment (keys on the lane's row bits) -> the same matrix as
    the B operand of O^T = V^T P^T (keys on its column bits): `movmatrix.trans` per 8 x 8 block, then the
    registers renamed."""
    t = gl.reshape(gl.permute(gl.reshape(movmatrix_trans(p), [2, 8, 8]), (0, 2, 1)), [16, 8])
    return gl.convert_layout(t, B_OP, assert_trivial=True)


@gluon.jit
def sequence_of(token, query_start_loc_ptr, num_seqs):
    """The sequence whose query rows hold packed query token `token`: the last i with qsl[i] <= token
    (`decode_io.token_sequence` in Gluon: a Gluon kernel cannot call a tile-language function)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if gl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@gluon.jit
def query_position(token, query_start_loc_ptr, seq_lens_ptr, num_seqs):
    """(sequence, position) of packed query token `token`. Decode batches (one query token a sequence) find it
    in one round of independent loads, token t being sequence t's; other batches then search (`sequence_of`,
    a load per halving: 7 in a row at 128 sequences, before the first page could be asked for)."""
    seq = gl.minimum(token, num_seqs - 1)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_end = gl.load(query_start_loc_ptr + seq + 1)
    seq_len = gl.load(seq_lens_ptr + seq)
    if (q_start > token) | (q_end <= token):
        seq = sequence_of(token, query_start_loc_ptr, num_seqs)
        q_start = gl.load(query_start_loc_ptr + seq)
        q_end = gl.load(query_start_loc_ptr + seq + 1)
        seq_len = gl.load(seq_lens_ptr + seq)
    return seq, seq_len - (q_end - q_start) + (token - q_start)


@gluon.jit
def split_range(end, split, num_splits):
    """The keys [kv_lo, kv_hi) of [0, end) split `split` attends, in whole 16-key steps but the last."""
    chunk = gl.cdiv(gl.cdiv(end, num_splits), 16) * 16
    kv_lo = split * chunk
    return kv_lo, gl.minimum(kv_lo + chunk, end)


@gluon.jit
def pages_end(q_pos, seq, window_first_ptr, BLOCK_SIZE: gl.constexpr, WINDOW: gl.constexpr):
    """The end of the keys a query at q_pos reads from the pages: q_pos + 1, or with a dense recent window
    (WINDOW) the first key of its sequence's window (`split_k.ring_partials` attends the rest, as one more
    split)."""
    end = q_pos + 1
    if WINDOW:
        end = gl.minimum(end, gl.load(window_first_ptr + seq) * BLOCK_SIZE)
    return end


@gluon.jit
def softmax_step(s, m_i, l_i, KEYS: gl.constexpr = 0, LANES: gl.constexpr = False):
    """One online-softmax step over masked scores^T s [16, 8] in log2 units, keys on axis KEYS (1 for the dense
    kernel's [heads, 16, 8]): (p, alpha [8], m_i, l_i). LANES: l_i is shaped as s, each lane's share of every
    head's sum (`sum_start`), added up across the lanes once after the loop (`sums_end`) rather than every step."""
    m_new = gl.maximum(m_i, gl.max(s, axis=KEYS))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - gl.expand_dims(m_safe, KEYS))
    alpha = gl.exp2(m_i - m_safe)
    if LANES:
        l_i = l_i * gl.expand_dims(alpha, KEYS) + p
    else:
        l_i = l_i * alpha + gl.sum(p, axis=KEYS)
    return p, alpha, m_new, l_i


@gluon.jit
def softmax_pair(sa, sb, m_i, l_i, LANES: gl.constexpr = False):
    """One online-softmax step over two masked score^T tiles of 16 keys (a 32-key loop step): (pa, pb, alpha
    [1, 8], m_i, l_i). LANES: as `softmax_step`'s."""
    m_new = gl.maximum(m_i, gl.max(gl.maximum(sa, sb), axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    pa = gl.exp2(sa - m_safe[None, :])
    pb = gl.exp2(sb - m_safe[None, :])
    alpha = gl.exp2(m_i - m_safe)
    if LANES:
        l_i = l_i * alpha[None, :] + pa + pb
    else:
        l_i = l_i * alpha + gl.sum(pa + pb, axis=0)
    return pa, pb, alpha[None, :], m_new, l_i


@gluon.jit
def sum_start(LANES: gl.constexpr):
    """The softmax sums before the first step: [8] heads, or with LANES each lane's share, [16, 8] (`softmax_step`)."""
    if LANES:
        l_i = gl.full([16, 8], 0.0, gl.float32, MMA)
    else:
        l_i = gl.full([8], 0.0, gl.float32, gl.SliceLayout(0, MMA))
    return l_i


@gluon.jit
def sums_end(l_i, LANES: gl.constexpr):
    """The softmax sums [8] after the last step: with LANES, the lanes' shares added up."""
    if LANES:
        l_i = gl.sum(l_i, axis=0)
    return l_i


@gluon.jit
def copy_q8_step(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, start, kv_hi, kr, kc, vr, vc, sr, k_strides, v_strides,
              ks_strides, vs_strides, k_sm, v_sm, ks_sm, vs_sm, BLOCK_SIZE: gl.constexpr,
              OFFSETS32: gl.constexpr = False):
    """Ask for the 16 keys from `start` into one stage of the shared ring (cp.async: no register holds them in
    flight), each lane the bytes it will read back: codes unmasked from the step's block (block 0 past the
    split's end), scales masked (zero)."""
    block = block_of(bt_row, start, kv_hi, BLOCK_SIZE, OFFSETS32)
    slot = start % BLOCK_SIZE
    async_copy.async_copy_global_to_shared(k_sm, k_ptr + block * k_strides[0] + (slot + kr[:, None]) * k_strides[1]
                                           + kc[None, :])
    async_copy.async_copy_global_to_shared(v_sm, v_ptr + block * v_strides[0] + (slot + vr[:, None]) * v_strides[1]
                                           + vc[None, :])
    s_ok = start + sr < kv_hi
    async_copy.async_copy_global_to_shared(ks_sm, ks_ptr + block * ks_strides[0] + (slot + sr) * ks_strides[1], s_ok)
    async_copy.async_copy_global_to_shared(vs_sm, vs_ptr + block * vs_strides[0] + (slot + sr) * vs_strides[1], s_ok)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits", "num_slots"])
def decode_q8_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, window_first_ptr, token_order_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, k_strides, v_strides, ks_strides, vs_strides,
    num_seqs, num_splits, num_slots, qk_scale,
    NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    SPLIT: gl.constexpr, K_LOAD: gl.constexpr, V_LOAD: gl.constexpr, STAGES: gl.constexpr = 2,
    PDL: gl.constexpr = False,
    WINDOW: gl.constexpr = False, ORDERED: gl.constexpr = False, OFFSETS32: gl.constexpr = False,
):
    launch_dependents(PDL)
    token, kv_head, split = program_coords(token_order_ptr, ORDERED)
    seq, q_pos = query_position(token, query_start_loc_ptr, seq_lens_ptr, num_seqs)

    kv_lo, kv_hi = split_range(pages_end(q_pos, seq, window_first_ptr, BLOCK_SIZE, WINDOW), split, num_splits)
    head_off = kv_head.to(gl.int64)
    k_ptr += head_off * k_strides[2]
    v_ptr += head_off * v_strides[2]
    ks_ptr += head_off * ks_strides[2]
    vs_ptr += head_off * vs_strides[2]
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt

    kr = gl.arange(0, 16, layout=gl.SliceLayout(1, K_LOAD))
    kc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, K_LOAD))
    vr = gl.arange(0, 16, layout=gl.SliceLayout(1, V_LOAD))
    vc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, V_LOAD))
    sr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    NJ: gl.constexpr = HEAD_DIM // 16
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    k_ring = gl.allocate_shared_memory(gl.int8, [STAGES, 16, HEAD_DIM], KEY_RING)
    v_ring = gl.allocate_shared_memory(gl.int8, [STAGES, 16, HEAD_DIM], KEY_RING)
    ks_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 16], FLAT)
    vs_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 16], FLAT)
    for st in gl.static_range(STAGES - 1):
        copy_q8_step(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kv_lo + 16 * st, kv_hi, kr, kc, vr, vc, sr, k_strides,
                  v_strides, ks_strides, vs_strides, k_ring.index(st), v_ring.index(st), ks_ring.index(st),
                  vs_ring.index(st), BLOCK_SIZE, OFFSETS32=OFFSETS32)

    qc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, PLAIN))
    qh = gl.arange(0, 8, layout=gl.SliceLayout(0, PLAIN))
    q_at = q_ptr + token.to(gl.int64) * stride_qt + (kv_head * GROUP + qh[None, :]) * stride_qh
    qt = gl.load(q_at + key_channel(qc, HEAD_DIM)[:, None], mask=(qh < GROUP)[None, :], other=0.0)
    qt = gl.convert_layout(qt.to(gl.float16), B_OP)

    acc = gl.full([HEAD_DIM, 8], 0.0, gl.float32, MMA)
    m_i = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l_i = gl.full([8], 0.0, gl.float32, gl.SliceLayout(0, MMA))
    scale = qk_scale * LOG2E
    stage = 0
    for start in range(kv_lo, kv_hi, 16):
        ahead = (stage + STAGES - 1) % STAGES
        copy_q8_step(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, start + 16 * (STAGES - 1), kv_hi, kr, kc, vr, vc, sr,
                  k_strides, v_strides, ks_strides, vs_strides, k_ring.index(ahead), v_ring.index(ahead),
                  ks_ring.index(ahead), vs_ring.index(ahead), BLOCK_SIZE, OFFSETS32=OFFSETS32)
        async_copy.wait_group(STAGES - 1)
        k8 = k_ring.index(stage).load(K_LOAD)
        v8 = v_ring.index(stage).load(V_LOAD)
        ks = ks_ring.index(stage).load(gl.SliceLayout(1, MMA))
        vs = vs_ring.index(stage).load(gl.SliceLayout(1, MMA))
        s_ok = start + sr < kv_hi
        ka = gl.reshape(gl.permute(gl.reshape(int8_to_f16(k8), [16, 4, NJ, 2, 2]), (0, 2, 3, 1, 4)), [16, HEAD_DIM])
        s = mma_v2(gl.convert_layout(ka, A_OP, assert_trivial=True), qt, gl.full([16, 8], 0.0, gl.float32, MMA))
        s = gl.where(s_ok[:, None], s * (ks * scale)[:, None], float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        pt = transpose_p((p * vs[:, None]).to(gl.float16))
        va = gl.reshape(gl.permute(gl.reshape(int8_to_f16(v8), [16, 8, NJ, 2]), (0, 2, 3, 1)), [16, HEAD_DIM])
        vt = gl.convert_layout(gl.permute(va, (1, 0)), A_OP, assert_trivial=True)
        acc = mma_v2(vt, pt, acc * alpha[None, :])
        stage = (stage + 1) % STAGES
    async_copy.wait_group(0)

    oc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, MMA))
    oh = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    h_ok = oh < GROUP
    head = kv_head * GROUP + oh
    chans = value_channel(oc, HEAD_DIM)[:, None]
    if SPLIT:
        state = (token.to(gl.int64) * NUM_Q_HEADS + head) * num_slots + split
        gl.store(part_m_ptr + state, m_i, mask=h_ok)
        gl.store(part_l_ptr + state, l_i, mask=h_ok)
        gl.store(part_out_ptr + state[None, :] * HEAD_DIM + chans, acc, mask=h_ok[None, :])
    else:
        inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
        o_at = out_ptr + token.to(gl.int64) * stride_ot + head[None, :] * stride_oh + chans
        gl.store(o_at, (acc * inv[None, :]).to(out_ptr.dtype.element_ty), mask=h_ok[None, :])


# TurboQuant at head_dim 128: keys q8_0 or q4_0, values q3_0 or q4_0 (codebook), four groups of 32 channels.
# Keys: lane (g, q) reads keys g and g + 8, bytes 8q .. 8q + 7 (q8_0) or 4q .. 4q + 3 (q4_0) of each
# group's bytes; a group is two k-steps of its own product, its scale and zero point on score rows.
# Values: lane (g, q) reads keys 2q, 2q + 1, 2q + 8, 2q + 9, units 2g and 2g + 1 (a unit: the codes of channels
# u, u + 16, .., u + 112; 3-bit: the M word and N byte of `packing.pack_code_nibbles`, 4-bit: a word of sign
# nibbles), so field j of its two units is channels 16j + 2g and 16j + 2g + 1: rows g and g + 8 of the V^T tile j,
# which lies in one scale group (its scale goes on P^T).
TQ_KEYS8 = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))
TQ_KEYS4 = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))
TQ_UNITS = gl.constexpr(gl.DistributedLinearLayout(   # [16 keys, 16 units or words]: keys 2q, 2q + 1 paired
    reg_bases=[[1, 0], [0, 1], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]], warp_bases=[],
    block_bases=[], shape=[16, 16]))
SCALE_WORDS = gl.constexpr(gl.BlockedLayout([1, 1], [2, 16], [1, 1], [1, 0]))  # [4 kinds (3 used), 16 keys] words
SCALE_ROW = gl.constexpr(gl.DistributedLinearLayout(   # [1, 16] scale words as the score rows hold them
    reg_bases=[[0, 8]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[], block_bases=[],
    shape=[1, 16]))


@gluon.jit
def tq_key_group(k_ring, stage, G: gl.constexpr, K_BITS: gl.constexpr):
    """Key group G of a step from the ring: [16 keys, 32 channels] float16 as the A operand, the codes left over an
    offset (`tq_query_group` takes its share off). q8_0: 1152 + c; lane q's bytes 8q + 4j + 2a + b are its operand
    columns 16j + 8a + 2q + b. q4_0: low nibbles 1024 + n, high ones 64 + n; lane q's bytes 4q + 2j + b, low (a = 0)
    and high (a = 1) nibbles, are columns 16a + 8b + 2q + j."""
    if K_BITS == 8:
        codes = k_ring.index(stage).slice(32 * G, 32, dim=1).load(TQ_KEYS8)
        k = gl.inline_asm_elementwise(INT8_OFFSET_ASM, "=r,=r,r", [codes], dtype=gl.float16, is_pure=True, pack=4)
        k = gl.reshape(gl.permute(gl.reshape(k, [16, 4, 2, 2, 2]), (0, 2, 3, 1, 4)), [16, 32])
    else:
        codes = k_ring.index(stage).slice(16 * G, 16, dim=1).load(TQ_KEYS4)
        lo, hi = gl.inline_asm_elementwise(NIBBLE_OFFSET_ASM, "=r,=r,=r,=r,r", [codes],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)   # bytes 0, 2, 1, 3
        k = gl.reshape(gl.permute(gl.reshape(gl.join(lo, hi), [16, 4, 2, 2, 2]), (0, 4, 2, 1, 3)), [16, 32])
    return gl.convert_layout(k, A_OP, assert_trivial=True)


# the float16 offset over the 8-bit TurboQuant key codes in `tq_key_group` (4-bit: 1024 low nibbles, 64 high ones)
KEY_OFFSET8 = gl.constexpr(1152.0)


@gluon.jit
def tq_query_group(q_at, h_ok, G: gl.constexpr, K_BITS: gl.constexpr):
    """Channels of key group G of the query heads, in tq_key_group's column order: (Q^T [32, 8] as the B
    operand, the group's channel sums [8] for the keys' zero points, and the start of the group's key products
    [16, 8]: minus the 4-bit keys' offsets times the query, so that the matrix product gives codes . q; zero for
    8-bit keys, whose one offset `key_zero` folds into the zero points)."""
    c = gl.arange(0, 32, layout=gl.SliceLayout(1, PLAIN))
    if K_BITS == 8:
        q_, j, a, b = (c >> 1) & 3, c >> 4, (c >> 3) & 1, c & 1
        stored = 32 * G + 8 * q_ + 4 * j + 2 * a + b
    else:
        q_, j, a, b = (c >> 1) & 3, c & 1, c >> 4, (c >> 3) & 1
        stored = 32 * G + 8 * q_ + 4 * j + 2 * b + a
    q = gl.load(q_at + stored[:, None], mask=h_ok[None, :], other=0.0).to(gl.float16)
    qf = q.to(gl.float32)
    qsum = gl.convert_layout(gl.sum(qf, axis=0), gl.SliceLayout(0, MMA))
    start = gl.full([16, 8], 0.0, gl.float32, MMA)
    if K_BITS == 4:
        offset = gl.where(a == 0, 1024.0, 64.0)
        start -= gl.convert_layout(gl.sum(qf * offset[:, None], axis=0), gl.SliceLayout(0, MMA))[None, :]
    return gl.convert_layout(q, B_OP), qsum, start


@triton.constexpr_function
def column_asm(G):
    """PTX for `column`: the word's halves as registers, its float16 G widened (one conversion of a half register,
    no shifts)."""
    word, half = ("lo", "hi")[G // 2], ("a", "b")[G % 2]
    return (f"{{ .reg .b32 lo, hi; .reg .b16 a, b; mov.b64 {{lo, hi}}, $1; mov.b32 {{a, b}}, {word}; "
            f"cvt.f32.f16 $0, {half}; }}")


@gluon.jit
def column(words, G: gl.constexpr, HALVES: gl.constexpr = False):
    """Group G's float16 of each key's four (one 8-byte word per key, [16] along the score rows), float32. HALVES:
    widened from the word's half register (`column_asm`), not shifted out first."""
    if HALVES:
        return gl.inline_asm_elementwise(column_asm(G), "=r,l", [words], dtype=gl.float32, is_pure=True, pack=1)
    h = ((words >> (16 * G)) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
    return h.to(gl.float32)


@gluon.jit
def code_tables(cb_ptr, runtime_zero):
    """The low-byte and high-byte tables of the 3-bit codebook's entries 0-3 (`conversions._f16_byte_words`), from
    its float16 entries in memory (cb_ptr): values the assembler cannot fold into immediates, so they stay in two
    registers through the loop (CODE_NIBBLES_TABLE_ASM). Each plus the lane's id times `runtime_zero` (0, from a
    kernel argument): the same values, but not the same in every lane as far as ptxas can tell, so it cannot park
    them in uniform registers and move them into regular ones before every look-up (which it did at 128 registers:
    543 loop instructions, now 516)."""
    w = gl.load(cb_ptr.to(gl.pointer_type(gl.int64)))   # entries 0-3, 16 bits each
    lo = w.to(gl.int32)
    hi = (w >> 32).to(gl.int32)
    l0 = (lo & 0xFF) | ((lo >> 8) & 0xFF00) | ((hi & 0xFF) << 16) | (((hi >> 16) & 0xFF) << 24)
    h0 = ((lo >> 8) & 0xFF) | ((lo >> 16) & 0xFF00) | ((hi << 8) & 0xFF0000) | (((hi >> 24) & 0xFF) << 24)
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    return l0 + lane * runtime_zero, h0 + lane * runtime_zero


@gluon.jit
def tq3_value_tiles(m_ring, n_ring, stage, l0=None, h0=None):
    """The step's 3-bit values from the ring as the eight V^T tiles [16 channels, 16 keys] float16 (tile j: field
    j of every unit, channels 16j + u), rows named g + 8a for unit 2g + a. The ring holds each unit's M word and N
    byte (`packing.pack_code_nibbles`)."""
    m = m_ring.index(stage).load(TQ_UNITS).to(gl.int32) & 0xFFFF
    n = n_ring.index(stage).load(TQ_UNITS).to(gl.int32) & 0xFF
    both = m | (n << 16)   # a unit's word and byte; asm pairs: keys 2q, 2q + 1 (same unit)
    if l0 is None:
        f = gl.inline_asm_elementwise(CODE_NIBBLES_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [both],
                                      dtype=(gl.float16,) * 8, is_pure=True, pack=2)   # fields 0, 1, 2, 3, 4, 6, 5, 7
    else:
        f = gl.inline_asm_elementwise(CODE_NIBBLES_TABLE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                      [both, gl.zeros_like(both) + l0, gl.zeros_like(both) + h0],
                                      dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    return (value_tile(f[0]), value_tile(f[1]), value_tile(f[2]), value_tile(f[3]),
            value_tile(f[4]), value_tile(f[6]), value_tile(f[5]), value_tile(f[7]))


@gluon.jit
def tq4_value_tiles(w_ring, stage):
    """The step's 4-bit values as sign nibbles in unit order (`packing.pack_sign_nibbles`: word w holds channels
    w + 16j, j = 0..7) as the eight V^T tiles (tile j: channels 16j + w, one scale group), rows named g + 8a for
    word 2g + a: the 3-bit values' tiles."""
    words = w_ring.index(stage).load(TQ_UNITS)
    f = gl.inline_asm_elementwise(SIGN_NIBBLES_KEY_PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                  dtype=(gl.float16,) * 8, is_pure=True, pack=2)   # fields 0, 2, 1, 3, 4, 6, 5, 7
    return (value_tile(f[0]), value_tile(f[2]), value_tile(f[1]), value_tile(f[3]),
            value_tile(f[4]), value_tile(f[6]), value_tile(f[5]), value_tile(f[7]))


@gluon.jit
def value_tile(f):
    """[16 keys, 16 units or words] -> V^T [16 rows, 16 keys] as the A operand, row g + 8a for unit 2g + a."""
    t = gl.reshape(gl.permute(gl.reshape(gl.permute(f, (1, 0)), [8, 2, 16]), (1, 0, 2)), [16, 16])
    return gl.convert_layout(t, A_OP, assert_trivial=True)


@gluon.jit
def copy_tq_step(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, start, kv_hi, k_strides, ks_strides, v_strides,
                 vs_strides, k_sm, s_sm, m_sm, n_sm, BLOCK_SIZE: gl.constexpr, K_BITS: gl.constexpr,
                 V_BITS: gl.constexpr, OFFSETS32: gl.constexpr = False, SCALES: gl.constexpr = True,
                 ROWS: gl.constexpr = False):
    """Ask for the 16 TurboQuant keys from `start` into one stage of the ring (cp.async): key codes (each lane its
    own runs), the four group scales and zero points of keys and the four scales of values as rows 0, 1, 2 of the
    stage's scale words (masked: zero), the values (3-bit: the units' M words and N bytes, rows of 32 and 16 bytes;
    4-bit: the units' words, rows of 64 bytes). Without SCALES (a probe) the scale words are not copied. ROWS:
    `slot_stride`'s."""
    copy_tq_block(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, block_of(bt_row, start, kv_hi, BLOCK_SIZE, OFFSETS32), start,
                  kv_hi, k_strides, ks_strides, v_strides, vs_strides, k_sm, s_sm, m_sm, n_sm, BLOCK_SIZE, K_BITS,
                  V_BITS, SCALES, ROWS)


@gluon.jit
def slot_stride(strides, ROW: gl.constexpr, ROWS: gl.constexpr):
    """A page tensor's slot stride (elements): ROW, its rows' size, where the launch found every page tensor
    head-major (ROWS: each slot's row right after the one before), so that a lane's copies are one address and
    immediate offsets; else the stride the launch passed."""
    if ROWS:
        return ROW
    return strides[1]


@gluon.jit
def copy_tq_block(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, block, start, kv_hi, k_strides, ks_strides, v_strides,
                  vs_strides, k_sm, s_sm, m_sm, n_sm, BLOCK_SIZE: gl.constexpr, K_BITS: gl.constexpr,
                  V_BITS: gl.constexpr, SCALES: gl.constexpr, ROWS: gl.constexpr = False):
    """`copy_tq_step` with the step's page block already loaded (`block_of`); ROWS: `slot_stride`'s."""
    slot = start % BLOCK_SIZE
    if K_BITS == 8:
        kr = gl.arange(0, 16, layout=gl.SliceLayout(1, COPY_ROWS))
        kc = gl.arange(0, 128, layout=gl.SliceLayout(0, COPY_ROWS))
    else:
        kr = gl.arange(0, 16, layout=gl.SliceLayout(1, Q4_KEYS))
        kc = gl.arange(0, 64, layout=gl.SliceLayout(0, Q4_KEYS))
    k_slot = slot_stride(k_strides, 16 * K_BITS, ROWS)
    async_copy.async_copy_global_to_shared(k_sm, k_ptr + block * k_strides[0] + (slot + kr[:, None]) * k_slot
                                           + kc[None, :])
    t = gl.arange(0, 4, layout=gl.SliceLayout(1, SCALE_WORDS))[:, None]   # a key's four fp16 as one 8-byte word
    sr = gl.arange(0, 16, layout=gl.SliceLayout(0, SCALE_WORDS))[None, :]
    k_row = block * ks_strides[0] + (slot + sr) * slot_stride(ks_strides, 4, ROWS)
    v_row = block * vs_strides[0] + (slot + sr) * slot_stride(vs_strides, 4, ROWS)
    s_at = gl.where(t == 0, ks_ptr + k_row, gl.where(t == 1, kz_ptr + k_row, vs_ptr + v_row))
    if SCALES:
        async_copy.async_copy_global_to_shared(s_sm, s_at.to(gl.pointer_type(gl.int64)),
                                               (start + sr < kv_hi) & (t < 3))
    if V_BITS == 3:
        vr = gl.arange(0, 16, layout=gl.SliceLayout(1, COPY_UNITS))
        vc = gl.arange(0, 16, layout=gl.SliceLayout(0, COPY_UNITS))
        v_row = v_ptr + block * v_strides[0] + (slot + vr[:, None]) * slot_stride(v_strides, 48, ROWS)
        async_copy.async_copy_global_to_shared(m_sm, (v_row.to(gl.pointer_type(gl.int16)) + vc[None, :]))
        async_copy.async_copy_global_to_shared(n_sm, v_row + 32 + vc[None, :])
    else:
        vr = gl.arange(0, 16, layout=gl.SliceLayout(1, COPY_WORDS))
        vc = gl.arange(0, 16, layout=gl.SliceLayout(0, COPY_WORDS))
        v_row = v_ptr + block * v_strides[0] + (slot + vr[:, None]) * slot_stride(v_strides, 64, ROWS)
        async_copy.async_copy_global_to_shared(m_sm, v_row.to(gl.pointer_type(gl.int32)) + vc[None, :])
    async_copy.commit_group()


@gluon.jit
def scale_row(s_ring, stage, KIND: gl.constexpr):
    """Row KIND of ring stage `stage`'s scale words (0: key scales, 1: key zero points, 2: value scales): [16] along
    the score rows."""
    w = s_ring.index(stage).slice(KIND, 1, dim=0).load(SCALE_ROW)
    return gl.convert_layout(gl.reshape(w, [16]), gl.SliceLayout(1, MMA), assert_trivial=True)


@gluon.jit
def key_zero(kz, G: gl.constexpr, K_BITS: gl.constexpr, HALVES: gl.constexpr = False):
    """Group G's key zero points [16] as the products of `tq_key_group`'s codes need them: 8-bit codes come
    1152 over, so the zero point is 1152 under."""
    z = column(kz, G, HALVES)
    if K_BITS == 8:
        z -= KEY_OFFSET8
    return z


@gluon.jit
def tq_scores(k_ring, s_ring, stage, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3, K_BITS: gl.constexpr,
              HALVES: gl.constexpr = False):
    """S^T [16 keys, 8 heads] of the TurboQuant keys in ring stage `stage` (unmasked, before the softmax scale);
    c0..c3: each group's start of the key products (`tq_query_group`)."""
    ks = scale_row(s_ring, stage, 0)
    kz = scale_row(s_ring, stage, 1)
    s = mma_v2(tq_key_group(k_ring, stage, 0, K_BITS), q0, c0)
    z = key_zero(kz, 0, K_BITS, HALVES)
    s = s * column(ks, 0, HALVES)[:, None] + (z * column(ks, 0, HALVES))[:, None] * qs0[None, :]
    s = group_scores(mma_v2(tq_key_group(k_ring, stage, 1, K_BITS), q1, c1), column(ks, 1, HALVES),
                     key_zero(kz, 1, K_BITS, HALVES), qs1, s)
    s = group_scores(mma_v2(tq_key_group(k_ring, stage, 2, K_BITS), q2, c2), column(ks, 2, HALVES),
                     key_zero(kz, 2, K_BITS, HALVES), qs2, s)
    s = group_scores(mma_v2(tq_key_group(k_ring, stage, 3, K_BITS), q3, c3), column(ks, 3, HALVES),
                     key_zero(kz, 3, K_BITS, HALVES), qs3, s)
    return s


@gluon.jit
def rescaled(acc, alpha, RESCALE: gl.constexpr):
    """acc * alpha, or acc as it is (the second half of a 32-key step, already rescaled)."""
    if RESCALE:
        acc = acc * alpha
    return acc


@gluon.jit
def tq_attend_values(p, m_ring, n_ring, s_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha,
                     V_BITS: gl.constexpr, RESCALE: gl.constexpr = True, l0=None, h0=None,
                     HALVES: gl.constexpr = False):
    """The eight accumulators (times alpha [1, 8] where RESCALE) plus V^T P^T of the TurboQuant values in ring
    stage `stage` (p: P^T [16 keys, 8 heads] float32, unnormalised). A value tile lies in one scale group (unit
    order): the scales go on P^T, once per group."""
    vs = scale_row(s_ring, stage, 2)
    p0 = transpose_p((p * column(vs, 0, HALVES)[:, None]).to(gl.float16))
    p1 = transpose_p((p * column(vs, 1, HALVES)[:, None]).to(gl.float16))
    p2 = transpose_p((p * column(vs, 2, HALVES)[:, None]).to(gl.float16))
    p3 = transpose_p((p * column(vs, 3, HALVES)[:, None]).to(gl.float16))
    if V_BITS == 3:
        v0, v1, v2, v3, v4, v5, v6, v7 = tq3_value_tiles(m_ring, n_ring, stage, l0, h0)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = tq4_value_tiles(m_ring, stage)
    acc0 = mma_v2(v0, p0, rescaled(acc0, alpha, RESCALE))
    acc1 = mma_v2(v1, p0, rescaled(acc1, alpha, RESCALE))
    acc2 = mma_v2(v2, p1, rescaled(acc2, alpha, RESCALE))
    acc3 = mma_v2(v3, p1, rescaled(acc3, alpha, RESCALE))
    acc4 = mma_v2(v4, p2, rescaled(acc4, alpha, RESCALE))
    acc5 = mma_v2(v5, p2, rescaled(acc5, alpha, RESCALE))
    acc6 = mma_v2(v6, p3, rescaled(acc6, alpha, RESCALE))
    acc7 = mma_v2(v7, p3, rescaled(acc7, alpha, RESCALE))
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.jit
def tq_step_softmax(k_ring, s_ring, stage, start, kv_hi, sr, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3, scale,
                    m_i, l_i, K_BITS: gl.constexpr, HALVES: gl.constexpr, LANE_SUMS: gl.constexpr):
    """A 16-key step's scores (ring stage `stage`, keys from `start`, masked at kv_hi) and its online-softmax step:
    (p, alpha [8], m_i, l_i)."""
    s = tq_scores(k_ring, s_ring, stage, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3, K_BITS, HALVES)
    s = gl.where((start + sr < kv_hi)[:, None], s * scale, float("-inf"))
    return softmax_step(s, m_i, l_i, LANES=LANE_SUMS)


@gluon.jit
def tq_skewed_loop(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, kv_lo, kv_hi, k_strides, ks_strides, v_strides,
                   vs_strides, k_ring, s_ring, m_ring, n_ring, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3,
                   scale, sr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, l0, h0,
                   BLOCK_SIZE: gl.constexpr, K_BITS: gl.constexpr, V_BITS: gl.constexpr, RING: gl.constexpr,
                   AHEAD: gl.constexpr, OFFSETS32: gl.constexpr, PROBE: gl.constexpr, HALVES: gl.constexpr,
                   ROWS: gl.constexpr, LANE_SUMS: gl.constexpr):
    """TQ_SKEW's key loop, software-pipelined: step j's scores and softmax (ring slot j % RING) beside step j - 1's
    value products (slot (j - 1) % RING, its probabilities and alpha kept from the step before); the first step's
    scores before the loop, the last step's values after it. AHEAD steps are copied ahead of the one scored (the
    prologue's), so RING = AHEAD + 2 slots: a copy never lands in the slot whose values are still to be read. An
    empty split scores one step of masked keys (zero-filled copies, p = 0) and leaves the state as the plain loop
    does: m -inf, sums and accumulators 0. (acc0, ..., acc7, m_i, l_i)."""
    gl.static_assert(RING == AHEAD + 2, "a ring slot for the values a step behind")
    if PROBE != PROBE_WORK:
        copy_tq_step(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, kv_lo + 16 * AHEAD, kv_hi, k_strides, ks_strides,
                     v_strides, vs_strides, k_ring.index(AHEAD), s_ring.index(AHEAD), m_ring.index(AHEAD),
                     n_ring.index(AHEAD), BLOCK_SIZE, K_BITS, V_BITS, OFFSETS32=OFFSETS32, ROWS=ROWS)
        async_copy.wait_group(AHEAD)
    p, alpha, m_i, l_i = tq_step_softmax(k_ring, s_ring, 0, kv_lo, kv_hi, sr, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0,
                                         c1, c2, c3, scale, m_i, l_i, K_BITS, HALVES, LANE_SUMS)
    behind = 0
    for start in range(kv_lo + 16, kv_hi, 16):
        stage = (behind + 1) % RING
        if PROBE != PROBE_WORK:
            ahead = (behind + 1 + AHEAD) % RING
            copy_tq_step(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, start + 16 * AHEAD, kv_hi, k_strides,
                         ks_strides, v_strides, vs_strides, k_ring.index(ahead), s_ring.index(ahead),
                         m_ring.index(ahead), n_ring.index(ahead), BLOCK_SIZE, K_BITS, V_BITS, OFFSETS32=OFFSETS32,
                         ROWS=ROWS)
            async_copy.wait_group(AHEAD)
        p_next, alpha_next, m_i, l_i = tq_step_softmax(k_ring, s_ring, stage, start, kv_hi, sr, q0, q1, q2, q3, qs0,
                                                       qs1, qs2, qs3, c0, c1, c2, c3, scale, m_i, l_i, K_BITS, HALVES,
                                                       LANE_SUMS)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tq_attend_values(
            p, m_ring, n_ring, s_ring, behind, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha[None, :], V_BITS,
            l0=l0, h0=h0, HALVES=HALVES)
        p = p_next
        alpha = alpha_next
        behind = stage
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tq_attend_values(
        p, m_ring, n_ring, s_ring, behind, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha[None, :], V_BITS,
        l0=l0, h0=h0, HALVES=HALVES)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits", "num_slots"])
def decode_tq_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, cb_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, window_first_ptr, token_order_ptr,
    stride_qt, stride_qh, stride_bt, k_strides, ks_strides, v_strides, vs_strides,
    num_seqs, num_splits, num_slots, qk_scale,
    NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, K_BITS: gl.constexpr,
    V_BITS: gl.constexpr, STAGES: gl.constexpr = 2, WINDOW: gl.constexpr = False, PAIRS: gl.constexpr = False,
    PDL: gl.constexpr = False, ORDERED: gl.constexpr = False, OFFSETS32: gl.constexpr = False,
    PROBE: gl.constexpr = 0, IDS_AHEAD: gl.constexpr = False, TABLES: gl.constexpr = False,
    HALVES: gl.constexpr = False, ROWS: gl.constexpr = False, LANE_SUMS: gl.constexpr = False,
    SKEW: gl.constexpr = False,
):
    """TurboQuant pages (head_dim 128): partial states only, in the rotated domain (the reduce kernel merges the
    splits, even one, and rotates back). PAIRS: 32 keys a loop step, as `decode_q4_kernel`'s. PROBE: one of PROBES'
    values (0: none). IDS_AHEAD (16 keys a step): each loop step loads the block id of the next step's copy. LANE_SUMS:
    the softmax sums stay in the lanes until the loop ends (`softmax_step`'s LANES). SKEW (16 keys a step):
    `tq_skewed_loop`."""
    gl.static_assert(not (IDS_AHEAD and PAIRS), "block ids a step ahead in steps of 16 keys")
    gl.static_assert(not SKEW or not (PAIRS or IDS_AHEAD), "a skewed loop takes plain 16-key steps")
    gl.static_assert(not SKEW or PROBE == 0 or PROBE == PROBE_WORK, "a skewed loop's probe: the work alone")
    launch_dependents(PDL)
    token, kv_head, split = program_coords(token_order_ptr, ORDERED)
    seq, q_pos = query_position(token, query_start_loc_ptr, seq_lens_ptr, num_seqs)

    kv_lo, kv_hi = split_range(pages_end(q_pos, seq, window_first_ptr, BLOCK_SIZE, WINDOW), split, num_splits)
    head_off = kv_head.to(gl.int64)
    k_ptr += head_off * k_strides[2]
    ks_ptr += head_off * ks_strides[2]
    kz_ptr += head_off * ks_strides[2]
    v_ptr += head_off * v_strides[2]
    vs_ptr += head_off * vs_strides[2]
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt

    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    RING: gl.constexpr = 4 if PAIRS else (STAGES + 1 if SKEW else STAGES)   # SKEW: the values a step behind too
    AHEAD: gl.constexpr = 2 if PAIRS else STAGES - 1
    k_ring = gl.allocate_shared_memory(gl.int8 if K_BITS == 8 else gl.uint8, [RING, 16, 128 * K_BITS // 8],
                                       KEY_RING if K_BITS == 8 else HALF_KEY_RING)
    s_ring = gl.allocate_shared_memory(gl.int64, [RING, 4, 16], FLAT)
    if V_BITS == 3:
        m_ring = gl.allocate_shared_memory(gl.int16, [RING, 16, 16], FLAT)
        n_ring = gl.allocate_shared_memory(gl.uint8, [RING, 16, 16], FLAT)
    else:
        m_ring = gl.allocate_shared_memory(gl.int32, [RING, 16, 16], WORD_RING)
        n_ring = m_ring
    for st in gl.static_range(AHEAD):
        if PROBE != PROBE_WORK:
            copy_tq_step(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, kv_lo + 16 * st, kv_hi, k_strides, ks_strides,
                         v_strides, vs_strides, k_ring.index(st), s_ring.index(st),
                         m_ring.index(st), n_ring.index(st), BLOCK_SIZE, K_BITS, V_BITS, OFFSETS32=OFFSETS32,
                         SCALES=PROBE != PROBE_CODES, ROWS=ROWS)

    qh = gl.arange(0, 8, layout=gl.SliceLayout(0, PLAIN))
    q_at = q_ptr + token.to(gl.int64) * stride_qt + (kv_head * GROUP + qh[None, :]) * stride_qh
    q0, qs0, c0 = tq_query_group(q_at, qh < GROUP, 0, K_BITS)
    q1, qs1, c1 = tq_query_group(q_at, qh < GROUP, 1, K_BITS)
    q2, qs2, c2 = tq_query_group(q_at, qh < GROUP, 2, K_BITS)
    q3, qs3, c3 = tq_query_group(q_at, qh < GROUP, 3, K_BITS)

    zero = gl.full([16, 8], 0.0, gl.float32, MMA)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    acc4 = zero
    acc5 = zero
    acc6 = zero
    acc7 = zero
    m_i = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l_i = sum_start(LANE_SUMS)
    scale = qk_scale * LOG2E
    sr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    stage = 0
    l0 = None
    h0 = None
    if TABLES and V_BITS == 3:
        l0, h0 = code_tables(cb_ptr, (num_seqs < 0).to(gl.int32))   # num_seqs >= 0: a zero
    if SKEW:
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i = tq_skewed_loop(
            k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, kv_lo, kv_hi, k_strides, ks_strides, v_strides, vs_strides,
            k_ring, s_ring, m_ring, n_ring, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3, scale, sr,
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, l0, h0, BLOCK_SIZE, K_BITS, V_BITS, RING, AHEAD,
            OFFSETS32, PROBE, HALVES, ROWS, LANE_SUMS)
    elif PAIRS:
        for start in range(kv_lo, kv_hi, 32):
            for st in gl.static_range(2):
                ahead = (stage + 2 + st) % 4
                copy_tq_step(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, bt_row, start + 32 + 16 * st, kv_hi, k_strides,
                             ks_strides, v_strides, vs_strides, k_ring.index(ahead), s_ring.index(ahead),
                             m_ring.index(ahead), n_ring.index(ahead), BLOCK_SIZE, K_BITS, V_BITS, OFFSETS32=OFFSETS32,
                             ROWS=ROWS)
            async_copy.wait_group(2)
            nxt = stage + 1
            sa = tq_scores(k_ring, s_ring, stage, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3,
                           K_BITS, HALVES)
            sb = tq_scores(k_ring, s_ring, nxt, q0, q1, q2, q3, qs0, qs1, qs2, qs3, c0, c1, c2, c3,
                           K_BITS, HALVES)
            sa = gl.where((start + sr < kv_hi)[:, None], sa * scale, float("-inf"))
            sb = gl.where((start + 16 + sr < kv_hi)[:, None], sb * scale, float("-inf"))
            pa, pb, alpha, m_i, l_i = softmax_pair(sa, sb, m_i, l_i, LANE_SUMS)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tq_attend_values(
                pa, m_ring, n_ring, s_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha, V_BITS,
                l0=l0, h0=h0, HALVES=HALVES)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tq_attend_values(
                pb, m_ring, n_ring, s_ring, nxt, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha, V_BITS,
                RESCALE=False, l0=l0, h0=h0, HALVES=HALVES)
            stage = (stage + 2) % 4
    else:
        if IDS_AHEAD:
            nxt = block_of(bt_row, kv_lo + 16 * (STAGES - 1), kv_hi, BLOCK_SIZE, OFFSETS32)
        for start in range(kv_lo, kv_hi, 16):
            ahead = (stage + STAGES - 1) % STAGES
            if PROBE != PROBE_WORK:
                block = nxt if IDS_AHEAD else block_of(bt_row, start + 16 * (STAGES - 1), kv_hi, BLOCK_SIZE, OFFSETS32)
                copy_tq_block(k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, block, start + 16 * (STAGES - 1), kv_hi,
                              k_strides, ks_strides, v_strides, vs_strides, k_ring.index(ahead), s_ring.index(ahead),
                              m_ring.index(ahead), n_ring.index(ahead), BLOCK_SIZE, K_BITS, V_BITS,
                              PROBE != PROBE_CODES, ROWS)
                if IDS_AHEAD:
                    nxt = block_of(bt_row, start + 16 * STAGES, kv_hi, BLOCK_SIZE, OFFSETS32)
                async_copy.wait_group(STAGES - 1)
            if PROBE != PROBE_COPIES and PROBE != PROBE_CODES:
                p, alpha, m_i, l_i = tq_step_softmax(k_ring, s_ring, stage, start, kv_hi, sr, q0, q1, q2, q3, qs0,
                                                     qs1, qs2, qs3, c0, c1, c2, c3, scale, m_i, l_i, K_BITS, HALVES,
                                                     LANE_SUMS)
                alpha = alpha[None, :]
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = tq_attend_values(
                    p, m_ring, n_ring, s_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha, V_BITS,
                    l0=l0, h0=h0, HALVES=HALVES)
            stage = (stage + 1) % STAGES
    async_copy.wait_group(0)
    l_i = sums_end(l_i, LANE_SUMS)

    oh = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    h_ok = oh < GROUP
    state = (token.to(gl.int64) * NUM_Q_HEADS + kv_head * GROUP + oh) * num_slots + split
    gl.store(part_m_ptr + state, m_i, mask=h_ok)
    gl.store(part_l_ptr + state, l_i, mask=h_ok)
    o_at = part_out_ptr + state[None, :] * 128
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    rows = (2 * (r & 7) + (r >> 3))[:, None]   # row g + 8a of tile j: channel 16j + 2g + a
    gl.store(o_at + rows, acc0, mask=h_ok[None, :])
    gl.store(o_at + 16 + rows, acc1, mask=h_ok[None, :])
    gl.store(o_at + 32 + rows, acc2, mask=h_ok[None, :])
    gl.store(o_at + 48 + rows, acc3, mask=h_ok[None, :])
    gl.store(o_at + 64 + rows, acc4, mask=h_ok[None, :])
    gl.store(o_at + 80 + rows, acc5, mask=h_ok[None, :])
    gl.store(o_at + 96 + rows, acc6, mask=h_ok[None, :])
    gl.store(o_at + 112 + rows, acc7, mask=h_ok[None, :])


@gluon.jit
def group_scores(d, sc, z, qsum, acc):
    """acc plus a key group's scores^T from d = codes . q: scale * (d + zero * sum(q)) (scale and zero per score
    row), summed so that each score takes two fused multiply-adds."""
    return d * sc[:, None] + ((z * sc)[:, None] * qsum[None, :] + acc)


def window_splits(query: torch.Tensor, meta, num_splits: int, window, split: bool):
    """(partial states or None, slots per (token, head), each sequence's first window block) of a Gluon decode
    over `num_splits` splits of the pages, with a dense recent window `window` (`decode.paged_attention`'s) as one
    more slot that `split_k.reduce_with_window` fills: the page splits then stop where each sequence's window begins
    (without a window the last argument is a placeholder the kernel does not read)."""
    from .split_k import partial_states

    num_slots = num_splits + (window is not None)
    parts = partial_states(query, num_slots, query.shape[-1]) if split or window is not None else None
    window_first = meta.window.first_block if window is not None else meta.seq_lens
    return parts, num_slots, window_first


def paged_attention_tq(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta, *, scale: float,
                       num_splits: int = 1, stages: int = STAGES, max_registers: int | None = None,
                       window=None, pairs: bool | None = None, ordered: bool | None = None,
                       offsets32: bool | None = None, probe: str | None = None,
                       ids_ahead: bool = False, tables: bool | None = None,
                       halves: bool | None = None, rows: bool | None = None,
                       lane_sums: bool | None = None, skew: bool | None = None) -> torch.Tensor:
    """`reference.paged_attention`'s contract for decodes over TurboQuant pages `supports_tq` accepts.
    `max_registers`: None = the measured cap (TQ_TUNING), 0 = uncapped, else that cap. `window`: a dense recent
    window (`window_splits`); `pairs`: 32 keys a loop step (the kernel's PAIRS; None: as timed, `TQ_PAIRS`);
    `ordered`: the launch order (`launch_grid`); `offsets32`: page offsets in 32 bits (`offsets_in_32_bits`);
    `probe`: a timing probe in place of attention (PROBES; 16 keys a step), its output not attention's;
    `ids_ahead`: block ids a step ahead (16 keys a step: pass pairs=False for K q4_0 / V q4_0; a probe); `tables`,
    `halves`, `rows`, `lane_sums`, `skew`: TQ_TABLES, TQ_HALVES, TQ_ROWS, LANE_SUMS, TQ_SKEW (None: as set there;
    rows only where the pages are `head_major`, skew in 16-key steps only)."""
    from .attention import check_inputs, dot_precision
    from .page_view import page_view, stride3
    from .split_k import dependent_launch, reduce_with_window

    from .decode import check_scale_words

    view = page_view(fmt, pages)
    check_inputs(query, view, meta)
    check_scale_words(view)
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    q = query
    if view.rotate_keys:   # keys stored rotated (k R): the scores are (q R) . (k R)
        q = (query.float() @ view.q_rotation).to(torch.float16)
    parts, num_slots, window_first = window_splits(query, meta, num_splits, window, True)
    if max_registers is None:
        max_registers = tq_tuning(fmt.spec)[0]
    if pairs is None:
        pairs = (fmt.spec.k_quant, fmt.spec.v_quant) in TQ_PAIRS
    assert probe is None or not pairs, "the probes take steps of 16 keys: pass pairs=False"
    skew = (TQ_SKEW if skew is None else skew) and not pairs and not ids_ahead
    grid, order, ordered = launch_grid(query, meta, view.num_kv_heads, num_splits, ordered)
    decode_tq_kernel[grid](
        *parts, q, view.k, view.k_scale, view.k_zero, view.v, view.v_scale, view.aux("codebook_f16"),
        meta.block_table, meta.seq_lens, meta.query_start_loc, window_first, order,
        q.stride(0), q.stride(1), meta.block_table.stride(0),
        stride3(view.k), stride3(view.k_scale), stride3(view.v), stride3(view.v_scale),
        meta.block_table.shape[0], num_splits, num_slots, float(scale),
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // view.num_kv_heads, BLOCK_SIZE=meta.block_size,
        K_BITS=view.k_bits, V_BITS=view.v_bits, STAGES=stages, WINDOW=window is not None, PAIRS=pairs,
        PDL=dependent_launch(query.device), ORDERED=ordered, OFFSETS32=offsets_in_32_bits(offsets32, view),
        PROBE=PROBES[probe] if probe else 0, IDS_AHEAD=ids_ahead, TABLES=TQ_TABLES if tables is None else tables,
        HALVES=TQ_HALVES if halves is None else halves, ROWS=(TQ_ROWS if rows is None else rows) and head_major(view),
        LANE_SUMS=LANE_SUMS if lane_sums is None else lane_sums, SKEW=skew, num_warps=1,
        **({"maxnreg": max_registers} if max_registers else {}))
    reduce_with_window(out, parts, query, view, meta, window, scale, dot_precision(query.dtype))
    return out


def head_major(view) -> bool:
    """Whether every TurboQuant page tensor is stored head-major (`page_view.stored_head_major`), so that its slot
    stride is its row's width: the constants `decode_tq_kernel` takes for them with ROWS (`slot_stride`; at head_dim
    128, 16 x key bits bytes of key codes, 48 or 64 bytes of values, four scales)."""
    from .page_view import stored_head_major

    return all(stored_head_major(t) for t in (view.k, view.k_scale, view.k_zero, view.v, view.v_scale))


# KV-Quant q4 and q6 at head_dim 128 (codes + 7 two per byte; q6: codes + 31, their low nibbles so, then a plane
# of their 2-bit high fields; one scale per token and head). Keys: lane (g, q) reads keys g and g + 8, nibble bytes
# 16q .. 16q + 15 (and q6 plane bytes 8q .. 8q + 7, each beside the two nibble bytes it completes), converted by
# SIGNED_NIBBLE_SPREAD_ASM or SIX_BIT_SPREAD_ASM (a word's bytes in the order 0, 2, 1, 3): the low (a = 0) and high
# (a = 1) nibbles of byte 16q + 4 (j >> 1) + 2b + (j & 1) are its operand columns 16j + 8a + 2q + b. Values as
# TurboQuant's 4-bit ones (`tq4_value_tiles`: words 2g, 2g + 1 of keys 2q, 2q + 1, 2q + 8, 2q + 9; q6: with the
# plane halfwords of the same channels), scales on P^T. The nibble bytes are copied and read as `Q4_KEYS`.
Q6_KEY_PLANE = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))


@gluon.jit
def copy_q4_step(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, start, kv_hi, k_strides, ks_strides, v_strides, vs_strides,
                 k_sm, ks_sm, w_sm, vs_sm, kp_sm, vp_sm, BLOCK_SIZE: gl.constexpr, BITS: gl.constexpr,
                 OFFSETS32: gl.constexpr = False):
    """Ask for the 16 q4 (q6) keys from `start` into one stage of the ring (cp.async, each lane its own runs): key
    nibble bytes, value nibble words, q6's key plane bytes and value plane halfwords, the key and value scales
    (masked: zero)."""
    block = block_of(bt_row, start, kv_hi, BLOCK_SIZE, OFFSETS32)
    slot = start % BLOCK_SIZE
    kr = gl.arange(0, 16, layout=gl.SliceLayout(1, Q4_KEYS))
    kc = gl.arange(0, 64, layout=gl.SliceLayout(0, Q4_KEYS))
    k_row = k_ptr + block * k_strides[0] + (slot + kr[:, None]) * k_strides[1]
    async_copy.async_copy_global_to_shared(k_sm, k_row + kc[None, :])
    vr = gl.arange(0, 16, layout=gl.SliceLayout(1, COPY_WORDS))
    vc = gl.arange(0, 16, layout=gl.SliceLayout(0, COPY_WORDS))
    v_row = v_ptr + block * v_strides[0] + (slot + vr[:, None]) * v_strides[1]
    async_copy.async_copy_global_to_shared(w_sm, v_row.to(gl.pointer_type(gl.int32)) + vc[None, :])
    if BITS == 6:   # the 2-bit planes after the 64 nibble bytes of a row
        pr = gl.arange(0, 16, layout=gl.SliceLayout(1, Q6_KEY_PLANE))
        pc = gl.arange(0, 32, layout=gl.SliceLayout(0, Q6_KEY_PLANE))
        p_row = k_ptr + block * k_strides[0] + (slot + pr[:, None]) * k_strides[1]
        async_copy.async_copy_global_to_shared(kp_sm, p_row + 64 + pc[None, :])
        async_copy.async_copy_global_to_shared(vp_sm, (v_row + 64).to(gl.pointer_type(gl.int16)) + vc[None, :])
    sr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    s_ok = start + sr < kv_hi
    async_copy.async_copy_global_to_shared(ks_sm, ks_ptr + block * ks_strides[0] + (slot + sr) * ks_strides[1], s_ok)
    async_copy.async_copy_global_to_shared(vs_sm, vs_ptr + block * vs_strides[0] + (slot + sr) * vs_strides[1], s_ok)
    async_copy.commit_group()


@gluon.jit
def q4_offset_start(qt, c):
    """The start of `q4_scores`' products with OFFSET keys, [16, 8] along the score rows: minus each query head's
    channels times the offsets their codes stand over (channel column c: a low nibble, 1024 + n, where (c >> 3) is
    even, a high one, 64 + n, where odd) plus the codes' own + 7, so that the product gives (n - 7) . q."""
    offset = gl.where(((c >> 3) & 1) == 0, 1031.0, 71.0)
    total = gl.sum(qt.to(gl.float32) * offset[:, None], axis=0)
    return gl.full([16, 8], 0.0, gl.float32, MMA) - gl.convert_layout(total, gl.SliceLayout(0, MMA))[None, :]


@gluon.jit
def q4_scores(k_ring, kp_ring, ks_ring, stage, qt, zero, scale, BITS: gl.constexpr, OFFSET: gl.constexpr = False):
    """S^T [16 keys, 8 heads] of the q4 (q6) keys in ring stage `stage`, times their scales and `scale`
    (unmasked). OFFSET (4-bit): the codes stay over their float16 offsets (`NIBBLE_OFFSET_ASM`: 1024 + n, 64 + n,
    no subtraction per value) and `zero` is the start of the products that takes the offsets and the codes' + 7
    off once (`q4_offset_start`)."""
    codes = k_ring.index(stage).load(Q4_KEYS)
    if BITS == 6:   # plane byte z beside nibble bytes 2z and 2z + 1
        kp = kp_ring.index(stage).load(Q6_KEY_PLANE)
        kp = gl.convert_layout(gl.reshape(gl.join(kp, kp), [16, 64]), Q4_KEYS, assert_trivial=True)
        lo, hi = gl.inline_asm_elementwise(SIX_BIT_SPREAD_ASM, "=r,=r,=r,=r,r,r", [codes, kp],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    elif OFFSET:
        lo, hi = gl.inline_asm_elementwise(NIBBLE_OFFSET_ASM, "=r,=r,=r,=r,r", [codes],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    else:
        lo, hi = gl.inline_asm_elementwise(SIGNED_NIBBLE_SPREAD_ASM, "=r,=r,=r,=r,r", [codes],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    k = gl.reshape(gl.permute(gl.reshape(gl.join(lo, hi), [16, 4, 8, 2, 2]), (0, 2, 4, 1, 3)), [16, 128])
    s = mma_v2(gl.convert_layout(k, A_OP, assert_trivial=True), qt, zero)
    return s * (ks_ring.index(stage).load(gl.SliceLayout(1, MMA)) * scale)[:, None]


@gluon.jit
def q4_attend_values(p, w_ring, vp_ring, vs_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha,
                     BITS: gl.constexpr, RESCALE: gl.constexpr = True):
    """The eight accumulators (times alpha [1, 8] where RESCALE) plus V^T P^T of the q4 (q6) values in ring stage
    `stage` (p: P^T [16 keys, 8 heads] float32, unnormalised; the value scales go on P^T)."""
    pt = transpose_p((p * vs_ring.index(stage).load(gl.SliceLayout(1, MMA))[:, None]).to(gl.float16))
    if BITS == 6:
        vp = vp_ring.index(stage).load(TQ_UNITS).to(gl.int32) & 0xFFFF
        f = gl.inline_asm_elementwise(SIX_BIT_KEY_PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                      [w_ring.index(stage).load(TQ_UNITS), vp], dtype=(gl.float16,) * 8,
                                      is_pure=True, pack=2)
    else:
        f = gl.inline_asm_elementwise(NIBBLE_KEY_PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r",
                                      [w_ring.index(stage).load(TQ_UNITS)], dtype=(gl.float16,) * 8,
                                      is_pure=True, pack=2)
    acc0 = mma_v2(value_tile(f[0]), pt, rescaled(acc0, alpha, RESCALE))
    acc1 = mma_v2(value_tile(f[1]), pt, rescaled(acc1, alpha, RESCALE))
    acc2 = mma_v2(value_tile(f[2]), pt, rescaled(acc2, alpha, RESCALE))
    acc3 = mma_v2(value_tile(f[3]), pt, rescaled(acc3, alpha, RESCALE))
    acc4 = mma_v2(value_tile(f[4]), pt, rescaled(acc4, alpha, RESCALE))
    acc5 = mma_v2(value_tile(f[5]), pt, rescaled(acc5, alpha, RESCALE))
    acc6 = mma_v2(value_tile(f[6]), pt, rescaled(acc6, alpha, RESCALE))
    acc7 = mma_v2(value_tile(f[7]), pt, rescaled(acc7, alpha, RESCALE))
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.jit
def q4_pair_softmax(k_ring, kp_ring, ks_ring, stage, start, kv_hi, sr, qt, products, scale, m_i, l_i,
                    BITS: gl.constexpr, OFFSET_KEYS: gl.constexpr, LANE_SUMS: gl.constexpr):
    """A 32-key step's scores (ring stages `stage` and `stage` + 1, keys from `start`, masked at kv_hi) and its
    online-softmax step: (pa, pb, alpha [1, 8], m_i, l_i)."""
    sa = q4_scores(k_ring, kp_ring, ks_ring, stage, qt, products, scale, BITS, OFFSET_KEYS)
    sb = q4_scores(k_ring, kp_ring, ks_ring, stage + 1, qt, products, scale, BITS, OFFSET_KEYS)
    sa = gl.where((start + sr < kv_hi)[:, None], sa, float("-inf"))
    sb = gl.where((start + 16 + sr < kv_hi)[:, None], sb, float("-inf"))
    return softmax_pair(sa, sb, m_i, l_i, LANE_SUMS)


@gluon.jit
def q4_attend_pair(pa, pb, alpha, w_ring, vp_ring, vs_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                   BITS: gl.constexpr):
    """The eight accumulators (times alpha) plus a 32-key step's value products (ring stages `stage`, `stage` + 1)."""
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = q4_attend_values(
        pa, w_ring, vp_ring, vs_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha, BITS)
    return q4_attend_values(pb, w_ring, vp_ring, vs_ring, stage + 1, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                            alpha, BITS, RESCALE=False)


@gluon.jit
def q4_skewed_pairs(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, kv_lo, kv_hi, k_strides, ks_strides, v_strides, vs_strides,
                    k_ring, ks_ring, w_ring, vs_ring, kp_ring, vp_ring, qt, products, scale, sr,
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, BLOCK_SIZE: gl.constexpr,
                    BITS: gl.constexpr, OFFSETS32: gl.constexpr, OFFSET_KEYS: gl.constexpr, LANE_SUMS: gl.constexpr):
    """Q4_SKEW's key loop in 32-key steps (two ring slots a step; the kernel's prologue copied step 0 into slots 0
    and 1), software-pipelined as `tq_skewed_loop`: step j's scores and softmax (slots 2j, 2j + 1 of six) beside
    step j - 1's value products (its probabilities and alpha kept from the step before), step j + 1 in flight; the
    first step's scores before the loop, the last step's values after it. (acc0, ..., acc7, m_i, l_i)."""
    for st in gl.static_range(2):
        copy_q4_step(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, kv_lo + 32 + 16 * st, kv_hi, k_strides, ks_strides,
                     v_strides, vs_strides, k_ring.index(2 + st), ks_ring.index(2 + st), w_ring.index(2 + st),
                     vs_ring.index(2 + st), kp_ring.index(2 + st), vp_ring.index(2 + st), BLOCK_SIZE, BITS,
                     OFFSETS32=OFFSETS32)
    async_copy.wait_group(2)
    pa, pb, alpha, m_i, l_i = q4_pair_softmax(k_ring, kp_ring, ks_ring, 0, kv_lo, kv_hi, sr, qt, products, scale, m_i,
                                              l_i, BITS, OFFSET_KEYS, LANE_SUMS)
    behind = 0
    for start in range(kv_lo + 32, kv_hi, 32):
        stage = (behind + 2) % 6
        for st in gl.static_range(2):
            ahead = (behind + 4 + st) % 6
            copy_q4_step(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, start + 32 + 16 * st, kv_hi, k_strides, ks_strides,
                         v_strides, vs_strides, k_ring.index(ahead), ks_ring.index(ahead), w_ring.index(ahead),
                         vs_ring.index(ahead), kp_ring.index(ahead), vp_ring.index(ahead), BLOCK_SIZE, BITS,
                         OFFSETS32=OFFSETS32)
        async_copy.wait_group(2)
        pa_next, pb_next, alpha_next, m_i, l_i = q4_pair_softmax(k_ring, kp_ring, ks_ring, stage, start, kv_hi, sr, qt,
                                                                 products, scale, m_i, l_i, BITS, OFFSET_KEYS,
                                                                 LANE_SUMS)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = q4_attend_pair(
            pa, pb, alpha, w_ring, vp_ring, vs_ring, behind, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BITS)
        pa = pa_next
        pb = pb_next
        alpha = alpha_next
        behind = stage
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = q4_attend_pair(
        pa, pb, alpha, w_ring, vp_ring, vs_ring, behind, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BITS)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits", "num_slots"])
def decode_q4_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, window_first_ptr, token_order_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, k_strides, ks_strides, v_strides, vs_strides,
    num_seqs, num_splits, num_slots, qk_scale,
    NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, SPLIT: gl.constexpr,
    STAGES: gl.constexpr = 2, BITS: gl.constexpr = 4, WINDOW: gl.constexpr = False, PAIRS: gl.constexpr = False,
    PDL: gl.constexpr = False, ORDERED: gl.constexpr = False, OFFSETS32: gl.constexpr = False,
    OFFSET_KEYS: gl.constexpr = False, LANE_SUMS: gl.constexpr = False, SKEW: gl.constexpr = False,
):
    """PAIRS: 32 keys a loop step (two ring stages read, one online-softmax step, two ahead in flight; the ring
    then has 4 stages), else 16 keys a step with STAGES - 1 ahead. LANE_SUMS: the softmax sums stay in the lanes
    until the loop ends (`softmax_step`'s LANES). SKEW (with PAIRS): `q4_skewed_pairs`, a ring of 6 stages."""
    gl.static_assert(not SKEW or PAIRS, "a skewed q4 loop takes 32-key steps")
    launch_dependents(PDL)
    token, kv_head, split = program_coords(token_order_ptr, ORDERED)
    seq, q_pos = query_position(token, query_start_loc_ptr, seq_lens_ptr, num_seqs)

    kv_lo, kv_hi = split_range(pages_end(q_pos, seq, window_first_ptr, BLOCK_SIZE, WINDOW), split, num_splits)
    head_off = kv_head.to(gl.int64)
    k_ptr += head_off * k_strides[2]
    ks_ptr += head_off * ks_strides[2]
    v_ptr += head_off * v_strides[2]
    vs_ptr += head_off * vs_strides[2]
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt

    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    WORDS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    RING: gl.constexpr = (6 if SKEW else 4) if PAIRS else STAGES   # SKEW: the values a step behind too
    AHEAD: gl.constexpr = 2 if PAIRS else STAGES - 1
    k_ring = gl.allocate_shared_memory(gl.uint8, [RING, 16, 64], gl.SwizzledSharedLayout(16, 1, 4, [1, 0]))
    w_ring = gl.allocate_shared_memory(gl.int32, [RING, 16, 16], WORD_RING)
    ks_ring = gl.allocate_shared_memory(gl.float32, [RING, 16], WORDS)
    vs_ring = gl.allocate_shared_memory(gl.float32, [RING, 16], WORDS)
    if BITS == 6:   # the 2-bit planes' rings (q4: names only, never read)
        kp_ring = gl.allocate_shared_memory(gl.uint8, [RING, 16, 32], FLAT)
        vp_ring = gl.allocate_shared_memory(gl.int16, [RING, 16, 16], FLAT)
    else:
        kp_ring = k_ring
        vp_ring = k_ring
    for st in gl.static_range(AHEAD):
        copy_q4_step(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, kv_lo + 16 * st, kv_hi, k_strides, ks_strides, v_strides,
                     vs_strides, k_ring.index(st), ks_ring.index(st), w_ring.index(st), vs_ring.index(st),
                     kp_ring.index(st), vp_ring.index(st), BLOCK_SIZE, BITS, OFFSETS32=OFFSETS32)

    c = gl.arange(0, 128, layout=gl.SliceLayout(1, PLAIN))
    qh = gl.arange(0, 8, layout=gl.SliceLayout(0, PLAIN))
    q_at = q_ptr + token.to(gl.int64) * stride_qt + (kv_head * GROUP + qh[None, :]) * stride_qh
    stored = 32 * ((c >> 1) & 3) + 8 * (c >> 5) + 4 * (c & 1) + 2 * ((c >> 4) & 1) + ((c >> 3) & 1)
    qt = gl.load(q_at + stored[:, None], mask=(qh < GROUP)[None, :], other=0.0).to(gl.float16)
    zero = gl.full([16, 8], 0.0, gl.float32, MMA)
    products = zero   # where the key products start (`q4_offset_start` with OFFSET_KEYS)
    if OFFSET_KEYS and BITS == 4:
        products = q4_offset_start(qt, c)
    qt = gl.convert_layout(qt, B_OP)

    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    acc4 = zero
    acc5 = zero
    acc6 = zero
    acc7 = zero
    m_i = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l_i = sum_start(LANE_SUMS)
    scale = qk_scale * LOG2E
    sr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    stage = 0
    if SKEW:
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i = q4_skewed_pairs(
            k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, kv_lo, kv_hi, k_strides, ks_strides, v_strides, vs_strides,
            k_ring, ks_ring, w_ring, vs_ring, kp_ring, vp_ring, qt, products, scale, sr,
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, BLOCK_SIZE, BITS, OFFSETS32, OFFSET_KEYS,
            LANE_SUMS)
    elif PAIRS:
        for start in range(kv_lo, kv_hi, 32):
            for st in gl.static_range(2):
                ahead = (stage + 2 + st) % 4
                copy_q4_step(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, start + 32 + 16 * st, kv_hi, k_strides,
                             ks_strides, v_strides, vs_strides, k_ring.index(ahead), ks_ring.index(ahead),
                             w_ring.index(ahead), vs_ring.index(ahead), kp_ring.index(ahead), vp_ring.index(ahead),
                             BLOCK_SIZE, BITS, OFFSETS32=OFFSETS32)
            async_copy.wait_group(2)
            pa, pb, alpha, m_i, l_i = q4_pair_softmax(k_ring, kp_ring, ks_ring, stage, start, kv_hi, sr, qt, products,
                                                      scale, m_i, l_i, BITS, OFFSET_KEYS, LANE_SUMS)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = q4_attend_pair(
                pa, pb, alpha, w_ring, vp_ring, vs_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, BITS)
            stage = (stage + 2) % 4
    else:
        for start in range(kv_lo, kv_hi, 16):
            ahead = (stage + STAGES - 1) % STAGES
            copy_q4_step(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, start + 16 * (STAGES - 1), kv_hi, k_strides,
                         ks_strides, v_strides, vs_strides, k_ring.index(ahead), ks_ring.index(ahead),
                         w_ring.index(ahead), vs_ring.index(ahead), kp_ring.index(ahead), vp_ring.index(ahead),
                         BLOCK_SIZE, BITS, OFFSETS32=OFFSETS32)
            async_copy.wait_group(STAGES - 1)
            s = q4_scores(k_ring, kp_ring, ks_ring, stage, qt, products, scale, BITS, OFFSET_KEYS)
            s = gl.where((start + sr < kv_hi)[:, None], s, float("-inf"))
            p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, LANES=LANE_SUMS)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = q4_attend_values(
                p, w_ring, vp_ring, vs_ring, stage, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                alpha[None, :], BITS)
            stage = (stage + 1) % STAGES
    async_copy.wait_group(0)
    l_i = sums_end(l_i, LANE_SUMS)

    oh = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    h_ok = oh < GROUP
    head = kv_head * GROUP + oh
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    rows = (16 * (r & 7) + 8 * (r >> 3))[:, None]   # row g + 8a of tile n: channel 8 (2g + a) + (0, 2, 1, 3, ..)[n]
    if SPLIT:
        state = (token.to(gl.int64) * NUM_Q_HEADS + head) * num_slots + split
        gl.store(part_m_ptr + state, m_i, mask=h_ok)
        gl.store(part_l_ptr + state, l_i, mask=h_ok)
        o_at = part_out_ptr + state[None, :] * 128 + rows
        inv = gl.full([8], 1.0, gl.float32, gl.SliceLayout(0, MMA))
    else:
        o_at = out_ptr + token.to(gl.int64) * stride_ot + head[None, :] * stride_oh + rows
        inv = 1.0 / gl.where(l_i > 0, l_i, 1.0)
    dt = o_at.dtype.element_ty
    gl.store(o_at, (acc0 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 2, (acc1 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 1, (acc2 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 3, (acc3 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 4, (acc4 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 6, (acc5 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 5, (acc6 * inv[None, :]).to(dt), mask=h_ok[None, :])
    gl.store(o_at + 7, (acc7 * inv[None, :]).to(dt), mask=h_ok[None, :])


def supports_q4(fmt, query: torch.Tensor, block_size: int, *, softcap=None, sliding_window=None, window=None) -> bool:
    """Whether `paged_attention_q4` reads this decode: KV-Quant q4 pages (keys not rotated), head_dim 128, groups
    of up to 8 query heads, blocks of a multiple of 16 slots, 16-bit queries, no soft-capping or sliding window; a
    dense recent window or not."""
    return fmt.spec.kind == "kvquant" and fmt.bits == 4 and _reads_q46(fmt, query, block_size, softcap, sliding_window)


def supports_q6(fmt, query: torch.Tensor, block_size: int, *, softcap=None, sliding_window=None, window=None) -> bool:
    """The same for KV-Quant q6 pages (`paged_attention_q4` reads both)."""
    return fmt.spec.kind == "kvquant" and fmt.bits == 6 and _reads_q46(fmt, query, block_size, softcap, sliding_window)


def _reads_q46(fmt, query, block_size, softcap, sliding_window) -> bool:
    return (fmt.key_signs is None and fmt.head_dim == 128
            and query.shape[1] // fmt.num_kv_heads <= 8 and block_size % 16 == 0
            and query.dtype in (torch.float16, torch.bfloat16) and not softcap and not sliding_window)


def paged_attention_q4(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta, *, scale: float,
                       num_splits: int = 1, stages: int = STAGES, max_registers: int | None = None,
                       window=None, pairs: bool | None = None, ordered: bool | None = None,
                       offsets32: bool | None = None, offset_keys: bool | None = None,
                       lane_sums: bool | None = None, skew: bool | None = None) -> torch.Tensor:
    """`reference.paged_attention`'s contract for the decodes `supports_q4` and `supports_q6` accept; `window`: a
    dense recent window (`window_splits`); `pairs`: 32 keys a loop step (the kernel's PAIRS; None: as timed,
    `Q4_PAIRS_BITS`); `ordered`: the launch order (`launch_grid`); `offsets32`: page offsets in 32 bits
    (`offsets_in_32_bits`); `offset_keys`, `lane_sums`, `skew`: Q4_OFFSET_KEYS (q4 only), LANE_SUMS, Q4_SKEW (None: as
    set there; skew in 32-key steps only)."""
    from .attention import check_inputs, dot_precision
    from .page_view import page_view, stride3
    from .split_k import dependent_launch, reduce_with_window

    view = page_view(fmt, pages)
    check_inputs(query, view, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    parts, num_slots, window_first = window_splits(query, meta, num_splits, window, num_splits > 1)
    if pairs is None:
        pairs = view.k_bits in Q4_PAIRS_BITS
    skew = (Q4_SKEW if skew is None else skew) and pairs
    if skew and max_registers is None:   # q4 skewed: 150 registers uncapped (12 programs a multiprocessor), none spilled
        max_registers = 128              # at 128 (16)
    grid, order, ordered = launch_grid(query, meta, view.num_kv_heads, num_splits, ordered)
    decode_q4_kernel[grid](
        out, *(parts or (out, out, out)), query, view.k, view.k_scale, view.v, view.v_scale,
        meta.block_table, meta.seq_lens, meta.query_start_loc, window_first, order,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        stride3(view.k), stride3(view.k_scale), stride3(view.v), stride3(view.v_scale),
        meta.block_table.shape[0], num_splits, num_slots, float(scale),
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // view.num_kv_heads, BLOCK_SIZE=meta.block_size,
        SPLIT=parts is not None, STAGES=stages, BITS=view.k_bits, WINDOW=window is not None, PAIRS=pairs,
        PDL=parts is not None and dependent_launch(query.device), ORDERED=ordered,
        OFFSETS32=offsets_in_32_bits(offsets32, view),
        OFFSET_KEYS=Q4_OFFSET_KEYS if offset_keys is None else offset_keys,
        LANE_SUMS=LANE_SUMS if lane_sums is None else lane_sums, SKEW=skew, num_warps=1,
        **({"maxnreg": max_registers} if max_registers else {}))
    reduce_with_window(out, parts, query, view, meta, window, scale, dot_precision(query.dtype))
    return out


def supports(fmt, query: torch.Tensor, block_size: int, *, softcap=None, sliding_window=None, window=None) -> bool:
    """Whether `paged_attention` here reads this decode: q8 pages, head_dim 64 or 128, groups of up to 8 query
    heads, blocks of a multiple of 16 slots, 16-bit queries, no soft-capping or sliding window; a dense recent
    window or not."""
    spec = fmt.spec
    return (spec.kind == "kvquant" and fmt.bits == 8 and fmt.key_signs is None and fmt.head_dim in (64, 128)
            and query.shape[1] // fmt.num_kv_heads <= 8 and block_size % 16 == 0
            and query.dtype in (torch.float16, torch.bfloat16) and not softcap and not sliding_window)


def supports_tq(fmt, query: torch.Tensor, block_size: int, *, softcap=None, sliding_window=None, window=None) -> bool:
    """Whether `paged_attention_tq` reads this decode: TurboQuant pages with q8_0 or q4_0 keys and q3_0 or q4_0
    values, head_dim 128, groups of up to 8 query heads, blocks of a multiple of 16 slots, 16-bit queries, no
    soft-capping or sliding window; a dense recent window or not."""
    spec = fmt.spec
    return (spec.kind == "turboquant" and spec.k_quant in ("q8_0", "q4_0") and spec.v_quant in ("q3_0", "q4_0")
            and fmt.head_dim == 128
            and query.shape[1] // fmt.num_kv_heads <= 8 and block_size % 16 == 0
            and query.dtype in (torch.float16, torch.bfloat16) and not softcap and not sliding_window)


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta, *, scale: float,
                    num_splits: int = 1, stages: int = STAGES, window=None, ordered: bool | None = None,
                    offsets32: bool | None = None) -> torch.Tensor:
    """`reference.paged_attention`'s contract for the decodes `supports` accepts; `window`: a dense recent window
    (`window_splits`); `ordered`: the launch order (`launch_grid`); `offsets32`: page offsets in 32 bits
    (`offsets_in_32_bits`)."""
    from .attention import check_inputs, dot_precision
    from .page_view import page_view, stride3
    from .split_k import dependent_launch, reduce_with_window

    view = page_view(fmt, pages)
    check_inputs(query, view, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    parts, num_slots, window_first = window_splits(query, meta, num_splits, window, num_splits > 1)
    grid, order, ordered = launch_grid(query, meta, view.num_kv_heads, num_splits, ordered)
    decode_q8_kernel[grid](
        out, *(parts or (out, out, out)), query, view.k, view.v, view.k_scale, view.v_scale,
        meta.block_table, meta.seq_lens, meta.query_start_loc, window_first, order,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale),
        meta.block_table.shape[0], num_splits, num_slots, float(scale),
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // view.num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=meta.block_size, SPLIT=parts is not None, K_LOAD=key_load_layout(head_dim),
        V_LOAD=value_load_layout(head_dim), STAGES=stages, WINDOW=window is not None,
        PDL=parts is not None and dependent_launch(query.device), ORDERED=ordered,
        OFFSETS32=offsets_in_32_bits(offsets32, view), num_warps=1)
    reduce_with_window(out, parts, query, view, meta, window, scale, dot_precision(query.dtype))
    return out



# Dense (bf16 / fp16) pages: no codes to name, so the ring is copied in plain 16-byte runs and read back with
# `ldmatrix` straight into the operand fragments (K as stored, V^T through a transposed view of the ring). A program
# reads HEADS KV heads of a (query token, split), warp h head h (rank-3 operands, the warp on the leading dimension;
# each warp's loop the one-head loop, instruction for instruction): it asks for those heads' rows of a block at once,
# one run of memory (pages are head-major), after one block-table load. One head's rows of a block are a 4 KB run
# (Llama-3-8B heads) at a random place over shuffled blocks, which reads 1.0-1.6% slower than blocks in order
# (`bench/page_read_probe.py`); four heads read 16 KB runs (DENSE_HEADS).


def dense_head_layouts(heads: int) -> dict:
    """The rank-3 layouts of `decode_dense_kernel` with `heads` warps, the warp on the leading dimension: the
    matrix-unit accumulator (a [16, 8] tile a warp), the copies' [heads, 16 keys, head_dim] and the query's [heads,
    head_dim, 8]."""
    return dict(MMA_W=gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[heads, 1, 1], instr_shape=[1, 16, 8]),
                COPY_W=gl.BlockedLayout([1, 1, 8], [1, 4, 8], [heads, 1, 1], [2, 1, 0]),
                PLAIN_W=gl.BlockedLayout([1, 1, 1], [1, 4, 8], [heads, 1, 1], [2, 1, 0]))


@gluon.jit
def transpose_p_heads(p, B_W: gl.constexpr):
    """`transpose_p` for each warp's [16, 8] tile of p [HEADS, 16, 8]."""
    W: gl.constexpr = p.shape[0]
    t = gl.reshape(gl.permute(gl.reshape(movmatrix_trans(p), [W, 2, 8, 8]), (0, 1, 3, 2)), [W, 16, 8])
    return gl.convert_layout(t, B_W, assert_trivial=True)


@gluon.jit
def dense_query(q_ptr, token, head0, stride_qt, stride_qh, DT: gl.constexpr, B_W: gl.constexpr,
                PLAIN_W: gl.constexpr, W: gl.constexpr, INNER: gl.constexpr, GROUP: gl.constexpr,
                HEAD_DIM: gl.constexpr):
    """The query heads of KV head head0 + w // INNER for each warp w, as the B operand [W, HEAD_DIM, 8] (GROUP of
    the 8 columns used)."""
    qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, PLAIN_W)))
    qc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, PLAIN_W)))
    qh = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, PLAIN_W)))
    q_head = (head0 + qw[:, None, None] // INNER) * GROUP + qh[None, None, :]
    q_at = q_ptr + token.to(gl.int64) * stride_qt + q_head * stride_qh + qc[None, :, None]
    qt = gl.load(q_at, mask=(qh < GROUP)[None, None, :], other=0.0)
    return gl.convert_layout(qt.to(DT), B_W)


@gluon.jit
def dense_attend(k_ring, v_ring, stage, qt, acc, m_i, l_i, key, hi, scale, A_W: gl.constexpr, B_W: gl.constexpr):
    """One 16-key step of every warp over ring stage `stage`: the scores of keys `key` ([warps or 1, 16], masked
    from `hi` on), an online-softmax step and the values' products: (acc, m_i, l_i)."""
    W: gl.constexpr = qt.shape[0]
    s = mma_v2(k_ring.index(stage).load(A_W), qt, gl.full([W, 16, 8], 0.0, gl.float32, acc.type.layout))
    s = gl.where((key < hi)[:, :, None], s * scale, float("-inf"))
    p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, 1)
    pt = transpose_p_heads(p.to(k_ring.dtype), B_W)
    acc = mma_v2(v_ring.index(stage).permute((0, 2, 1)).load(A_W), pt, acc * alpha[:, None, :])
    return acc, m_i, l_i


@gluon.jit
def copy_dense_step(k_ptr, v_ptr, bt_row, start, kv_hi, k_strides, v_strides, k_sm, v_sm, HEAD_DIM: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr, HEADS: gl.constexpr, COPY_W: gl.constexpr,
                    OFFSETS32: gl.constexpr = False):
    """Ask for HEADS heads' rows of the 16 keys from `start` into one stage of the ring, warp h head h's (cp.async,
    16-byte runs; rows past the sequence's end are masked zero: a slot never written may hold NaN)."""
    copy_dense_block(k_ptr, v_ptr, block_of(bt_row, start, kv_hi, BLOCK_SIZE, OFFSETS32), start, kv_hi, k_strides,
                     v_strides, k_sm, v_sm, HEAD_DIM, BLOCK_SIZE, HEADS, COPY_W)


@gluon.jit
def copy_dense_block(k_ptr, v_ptr, block, start, kv_hi, k_strides, v_strides, k_sm, v_sm, HEAD_DIM: gl.constexpr,
                     BLOCK_SIZE: gl.constexpr, HEADS: gl.constexpr, COPY_W: gl.constexpr):
    """`copy_dense_step` with the step's page block already loaded (`block_of`)."""
    slot = start % BLOCK_SIZE
    h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY_W)))
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY_W)))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY_W)))
    ok = (start + r < kv_hi)[None, :, None]
    k_rows = h[:, None] * k_strides[2] + (slot + r[None, :]) * k_strides[1]
    v_rows = h[:, None] * v_strides[2] + (slot + r[None, :]) * v_strides[1]
    async_copy.async_copy_global_to_shared(k_sm, k_ptr + block * k_strides[0] + k_rows[:, :, None] + c[None, None, :],
                                           ok)
    async_copy.async_copy_global_to_shared(v_sm, v_ptr + block * v_strides[0] + v_rows[:, :, None] + c[None, None, :],
                                           ok)
    async_copy.commit_group()


@gluon.jit
def copy_dense_warps(k_ptr, v_ptr, bt_row, start, hi, head, k_strides, v_strides, k_sm, v_sm, HEAD_DIM: gl.constexpr,
                     BLOCK_SIZE: gl.constexpr, COPY_W: gl.constexpr, OFFSETS32: gl.constexpr):
    """`copy_dense_step` where each warp reads its own keys: warp w head `head[w]`'s rows of the 16 keys from
    `start[w]` (masked zero from `hi[w]` on), each warp's block id loaded for it."""
    block = gl.load(bt_row + start // BLOCK_SIZE, mask=start < hi, other=0)
    if not OFFSETS32:
        block = block.to(gl.int64)
    slot = start % BLOCK_SIZE
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, COPY_W)))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY_W)))
    ok = (start[:, None] + r[None, :] < hi[:, None])[:, :, None]
    row = slot[:, None] + r[None, :]
    k_rows = block[:, None] * k_strides[0] + head[:, None] * k_strides[2] + row * k_strides[1]
    v_rows = block[:, None] * v_strides[0] + head[:, None] * v_strides[2] + row * v_strides[1]
    async_copy.async_copy_global_to_shared(k_sm, k_ptr + k_rows[:, :, None] + c[None, None, :], ok)
    async_copy.async_copy_global_to_shared(v_sm, v_ptr + v_rows[:, :, None] + c[None, None, :], ok)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits"])
def decode_dense_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, q_ptr, k_ptr, v_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, token_order_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, k_strides, v_strides,
    num_seqs, num_splits, qk_scale,
    NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    SPLIT: gl.constexpr, HEADS: gl.constexpr, MMA_W: gl.constexpr, COPY_W: gl.constexpr, PLAIN_W: gl.constexpr,
    STAGES: gl.constexpr = 2, PDL: gl.constexpr = False, ORDERED: gl.constexpr = False,
    OFFSETS32: gl.constexpr = False, IDS_AHEAD: gl.constexpr = False, INNER: gl.constexpr = 1,
):
    """HEADS KV heads of one query token's key range (split `split` of num_splits), a warp each; with INNER > 1
    the range is split again INNER ways inside the program: HEADS x INNER warps, warp h * INNER + s reading head
    h's keys of inner split s (`copy_dense_warps`), every warp the same number of 16-key steps, and the warps of a
    head merge their states through shared memory at the end, so without splits across
    programs (SPLIT) the program writes the output itself and no reduce kernel runs after it. IDS_AHEAD (INNER 1
    only): each loop step loads the block id of the next step's copy, so a copy never waits for its id."""
    launch_dependents(PDL)
    token, head_group, split = program_coords(token_order_ptr, ORDERED)
    head0 = head_group * HEADS
    seq, q_pos = query_position(token, query_start_loc_ptr, seq_lens_ptr, num_seqs)
    DT: gl.constexpr = k_ptr.dtype.element_ty
    W: gl.constexpr = HEADS * INNER
    A_W: gl.constexpr = gl.DotOperandLayout(0, MMA_W, 2)
    B_W: gl.constexpr = gl.DotOperandLayout(1, MMA_W, 2)

    kv_lo, kv_hi = split_range(q_pos + 1, split, num_splits)
    if INNER > 1:
        chunk = gl.cdiv(gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), INNER), 16) * 16   # each inner split's keys
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt
    k_ptr += head0.to(gl.int64) * k_strides[2]
    v_ptr += head0.to(gl.int64) * v_strides[2]
    if INNER > 1:
        wc = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, COPY_W)))   # warp w's keys, as copied
        lo_c = kv_lo + (wc % INNER) * chunk
        hi_c = gl.minimum(lo_c + chunk, kv_hi)
        head_c = wc // INNER
        wm = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA_W)))    # and as the scores see them
        lo_m = kv_lo + (wm % INNER) * chunk
        hi_m = gl.minimum(lo_m + chunk, kv_hi)

    RING: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
    k_ring = gl.allocate_shared_memory(DT, [STAGES, W, 16, HEAD_DIM], RING)
    v_ring = gl.allocate_shared_memory(DT, [STAGES, W, 16, HEAD_DIM], RING)
    for st in gl.static_range(STAGES - 1):
        if INNER == 1:
            copy_dense_step(k_ptr, v_ptr, bt_row, kv_lo + 16 * st, kv_hi, k_strides, v_strides, k_ring.index(st),
                            v_ring.index(st), HEAD_DIM, BLOCK_SIZE, HEADS, COPY_W, OFFSETS32=OFFSETS32)
        else:
            copy_dense_warps(k_ptr, v_ptr, bt_row, lo_c + 16 * st, hi_c, head_c, k_strides, v_strides,
                             k_ring.index(st), v_ring.index(st), HEAD_DIM, BLOCK_SIZE, COPY_W, OFFSETS32)

    # the query once the first pages are asked for: its load's latency hides under theirs
    qt = dense_query(q_ptr, token, head0, stride_qt, stride_qh, DT, B_W, PLAIN_W, W, INNER, GROUP, HEAD_DIM)

    acc = gl.full([W, HEAD_DIM, 8], 0.0, gl.float32, MMA_W)
    m_i = gl.full([W, 8], float("-inf"), gl.float32, gl.SliceLayout(1, MMA_W))
    l_i = gl.full([W, 8], 0.0, gl.float32, gl.SliceLayout(1, MMA_W))
    scale = qk_scale * LOG2E
    sr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA_W)))
    stage = 0
    if INNER == 1:
        if IDS_AHEAD:
            nxt = block_of(bt_row, kv_lo + 16 * (STAGES - 1), kv_hi, BLOCK_SIZE, OFFSETS32)
        for start in range(kv_lo, kv_hi, 16):
            ahead = (stage + STAGES - 1) % STAGES
            block = nxt if IDS_AHEAD else block_of(bt_row, start + 16 * (STAGES - 1), kv_hi, BLOCK_SIZE, OFFSETS32)
            copy_dense_block(k_ptr, v_ptr, block, start + 16 * (STAGES - 1), kv_hi, k_strides, v_strides,
                             k_ring.index(ahead), v_ring.index(ahead), HEAD_DIM, BLOCK_SIZE, HEADS, COPY_W)
            if IDS_AHEAD:
                nxt = block_of(bt_row, start + 16 * STAGES, kv_hi, BLOCK_SIZE, OFFSETS32)
            async_copy.wait_group(STAGES - 1)
            acc, m_i, l_i = dense_attend(k_ring, v_ring, stage, qt, acc, m_i, l_i, (start + sr)[None, :], kv_hi,
                                         scale, A_W, B_W)
            stage = (stage + 1) % STAGES
    else:
        for i in range(0, chunk // 16):
            ahead = (stage + STAGES - 1) % STAGES
            copy_dense_warps(k_ptr, v_ptr, bt_row, lo_c + 16 * (i + STAGES - 1), hi_c, head_c, k_strides,
                             v_strides, k_ring.index(ahead), v_ring.index(ahead), HEAD_DIM, BLOCK_SIZE, COPY_W,
                             OFFSETS32)
            async_copy.wait_group(STAGES - 1)
            acc, m_i, l_i = dense_attend(k_ring, v_ring, stage, qt, acc, m_i, l_i,
                                         (lo_m + 16 * i)[:, None] + sr[None, :], hi_m[:, None], scale, A_W, B_W)
            stage = (stage + 1) % STAGES
    async_copy.wait_group(0)

    if INNER == 1:
        # warp h's [head_dim, 8] output columns: query heads h * GROUP + 0 .. GROUP - 1
        ow = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA_W)))
        oc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA_W)))
        oh = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA_W)))
        mw = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA_W)))
        mh = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA_W)))
        if not SPLIT:
            acc = acc * (1.0 / gl.where(l_i > 0, l_i, 1.0))[:, None, :]
    else:
        # each head's INNER states merged: [HEADS, INNER, ...] with a head's inner splits in one lane's registers;
        # the merge's buffers may reuse the rings, so every warp's last copies land and its reads end first
        gl.thread_barrier()
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        acc_sm = gl.allocate_shared_memory(gl.float32, [W, HEAD_DIM, 8], FLAT, acc)
        m_sm = gl.allocate_shared_memory(gl.float32, [W, 8], FLAT2, m_i)
        l_sm = gl.allocate_shared_memory(gl.float32, [W, 8], FLAT2, l_i)
        gl.thread_barrier()
        L4: gl.constexpr = gl.BlockedLayout([1, INNER, 1, 1], [1, 1, 4, 8], [HEADS, 1, INNER, 1], [3, 2, 1, 0])
        L3: gl.constexpr = gl.SliceLayout(2, L4)          # [HEADS, INNER, 8]
        m = m_sm.reshape([HEADS, INNER, 8]).load(L3)
        l = l_sm.reshape([HEADS, INNER, 8]).load(L3)
        m_i = gl.max(m, axis=1)
        w = gl.exp2(m - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None, :])
        l_i = gl.sum(w * l, axis=1)
        if not SPLIT:
            w = w / gl.where(l_i > 0, l_i, 1.0)[:, None, :]
        acc = gl.sum(acc_sm.reshape([HEADS, INNER, HEAD_DIM, 8]).load(L4) * gl.expand_dims(w, 2), axis=1)
        O3: gl.constexpr = gl.SliceLayout(1, L4)          # [HEADS, HEAD_DIM, 8]
        ow = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(2, O3)))
        oc = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, O3)))
        oh = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, O3)))
        mw = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(1, L3)))
        mh = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))

    # head h's [head_dim, 8] output columns (acc; normalised unless SPLIT): query heads h * GROUP + 0 .. GROUP - 1
    head = (head0 + ow[:, None, None]) * GROUP + oh[None, None, :]
    h_ok = (oh < GROUP)[None, None, :]
    if SPLIT:
        m_state = (token.to(gl.int64) * NUM_Q_HEADS + (head0 + mw[:, None]) * GROUP + mh[None, :]) * num_splits + split
        gl.store(part_m_ptr + m_state, m_i, mask=(mh < GROUP)[None, :])
        gl.store(part_l_ptr + m_state, l_i, mask=(mh < GROUP)[None, :])
        state = (token.to(gl.int64) * NUM_Q_HEADS + head) * num_splits + split
        gl.store(part_out_ptr + state * HEAD_DIM + oc[None, :, None], acc, mask=h_ok)
    else:
        o_at = out_ptr + token.to(gl.int64) * stride_ot + head * stride_oh + oc[None, :, None]
        gl.store(o_at, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def supports_dense(fmt, query: torch.Tensor, block_size: int, *, softcap=None, sliding_window=None,
                   window=None) -> bool:
    """Whether `paged_attention_dense` reads this decode: dense pages of the query's 16-bit dtype, head_dim 64 or
    128, groups of up to 8 query heads, blocks of a multiple of 16 slots, no soft-capping, sliding window."""
    return (fmt.spec.kind == "dense" and fmt.head_dim in (64, 128) and query.shape[1] // fmt.num_kv_heads <= 8
            and block_size % 16 == 0 and query.dtype in (torch.float16, torch.bfloat16) and not softcap
            and not sliding_window and window is None)


def dense_heads(num_kv_heads: int) -> int:
    """KV heads a program of the dense decode reads: DENSE_HEADS where they divide the heads, else one."""
    return DENSE_HEADS if num_kv_heads % DENSE_HEADS == 0 else 1


def dense_plan(num_kv_heads: int, num_splits: int, num_tokens: int = 0, head_dim: int = 128,
               num_sms: int = 0) -> tuple[int, int, int]:
    """(KV heads a program, splits inside it, splits across programs) of the dense decode for `num_tokens` query
    tokens at the split count `num_splits` the split rule gives (served where DENSE_INNER): one split stays one; more go
    inside a program, up to DENSE_INNER_MAX (a power of two, at least the splits asked for where they fit), the rest
    across programs; eight warps a program where at head_dim 128 they fill their last wave of `num_sms`
    multiprocessors DENSE_WAVE_FILL full, else four (num_sms 0: four, as where eight warps' rings do not fit)."""
    heads = dense_heads(num_kv_heads)
    if num_splits < 2:
        return heads, 1, num_splits
    inner = 1 << (min(num_splits, DENSE_INNER_MAX) - 1).bit_length()
    outer = -(-num_splits // inner)
    wide = max(1, min(heads, 8 // inner))
    waves = num_tokens * (num_kv_heads // wide) * outer / max(num_sms, 1)
    if head_dim == 128 and num_sms and (waves % 1 == 0 or waves % 1 >= DENSE_WAVE_FILL):
        return wide, inner, outer
    return max(1, min(heads, 4 // inner)), inner, outer


def paged_attention_dense(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta, *, scale: float,
                          num_splits: int = 1, stages: int = STAGES, heads: int | None = None,
                          ordered: bool | None = None, offsets32: bool | None = None,
                          ids_ahead: bool | None = None, inner: int | None = None, plan: bool | None = None,
                          probe: str | None = None) -> torch.Tensor:
    """`reference.paged_attention`'s contract for the decodes `supports_dense` accepts (pages of the query's
    dtype). `heads`: KV heads a program reads, a warp each (by default `dense_heads`); `ordered`: the launch order
    (`launch_grid`); `offsets32`: page offsets in 32 bits (`offsets_in_32_bits`); `ids_ahead`: block ids a step
    ahead (None: DENSE_IDS_AHEAD; without inner splits only); `inner`: each program's keys split again this many
    ways among its warps (`decode_dense_kernel`'s INNER: heads x inner warps, merged in the program;
    `num_splits` then counts the splits across programs). `plan` (None: DENSE_INNER), with none of `heads`,
    `inner` and `ids_ahead` given: `num_splits` is the split rule's count and `dense_plan` lays it out.
    `probe="pages"` (timing only): the page kernel without the split reduce after it (the output is not
    attention)."""
    from .attention import check_inputs
    from .page_view import page_view, stride3
    from .split_k import dependent_launch, partial_states, reduce_splits

    view = page_view(fmt, pages)
    check_inputs(query, view, meta)
    if view.k.dtype != query.dtype:
        raise ValueError(f"the Gluon dense decode reads pages of the query's dtype: pages {view.k.dtype}, "
                         f"query {query.dtype}")
    if probe not in (None, "pages"):
        raise ValueError(f"probe={probe!r}: the dense decode's only probe is 'pages'")
    num_tokens, num_q_heads, head_dim = query.shape
    if (DENSE_INNER if plan is None else plan) and heads is None and inner is None and not ids_ahead:
        from .tuning import multiprocessor_count, shared_memory_per_program

        # eight-warp programs only where their rings fit a program's shared memory (not on sm_89's 99 KB)
        index = query.device.index or 0
        wide = (query.device.type == "cuda"
                and shared_memory_per_program(index) >= 8 * stages * 16 * head_dim * 2 * query.element_size())
        sms = multiprocessor_count(index) if wide else 0
        heads, inner, num_splits = dense_plan(view.num_kv_heads, num_splits, num_tokens, head_dim, sms)
    heads = dense_heads(view.num_kv_heads) if heads is None else heads
    inner = 1 if inner is None else inner
    if inner < 1 or inner & (inner - 1):
        raise ValueError(f"inner={inner}: splits inside a program come in powers of two")
    if view.num_kv_heads % heads:
        raise ValueError(f"heads={heads} must divide the pages' {view.num_kv_heads} KV heads")
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    split = num_splits > 1
    parts = partial_states(query, num_splits, head_dim) if split else (out, out, out)
    grid, order, ordered = launch_grid(query, meta, view.num_kv_heads // heads, num_splits, ordered)
    args = (out, *parts, query, view.k, view.v, meta.block_table, meta.seq_lens, meta.query_start_loc, order,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
            stride3(view.k), stride3(view.v), meta.block_table.shape[0], num_splits, float(scale))
    common = dict(NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // view.num_kv_heads, HEAD_DIM=head_dim,
                  BLOCK_SIZE=meta.block_size, SPLIT=split, HEADS=heads, **dense_head_layouts(heads * inner),
                  STAGES=stages, PDL=split and probe is None and dependent_launch(query.device), ORDERED=ordered,
                  OFFSETS32=offsets_in_32_bits(offsets32, view), num_warps=heads * inner)
    ids_ahead = inner == 1 and (DENSE_IDS_AHEAD if ids_ahead is None else ids_ahead)
    decode_dense_kernel[grid](*args, INNER=inner, IDS_AHEAD=ids_ahead, **common)
    if split and probe is None:
        reduce_splits(out, parts, view)
    return out


# Each format's Gluon kernel: (whether it reads a decode, its launcher)
KERNELS = {"q8": (supports, paged_attention), "q4": (supports_q4, paged_attention_q4),
           "q6": (supports_q6, paged_attention_q4), "turboquant": (supports_tq, paged_attention_tq),
           "off": (supports_dense, paged_attention_dense)}
# The formats whose Gluon kernel serves decode batches by default: each joins once it is timed faster than
# `decode.py` (for `off`: the varlen / split-K kernels) at every shape of `bench/gluon_probe.py`, at the split count
# PROGRAMS_PER_SM gives (BENCHMARKS.md, H200, 2026-12-02): q8 1.06-1.11x; TurboQuant K q8_0 / V q3_0 1.07-1.12x,
# K q4_0 / V q4_0 1.03-1.08x; q4 1.03-1.08x; `off` 1.01-1.08x; q6 (the q4 kernel with the 2-bit planes) 1.29-1.37x.
DEFAULT_KERNELS = ("q8", "q6", "q4", "turboquant", "off")


def tq_tuning(spec) -> tuple[int | None, int]:
    """(register cap or None, programs per multiprocessor) of the TurboQuant kernel for format `spec`."""
    return TQ_TUNING.get((spec.k_quant, spec.v_quant), (None, PROGRAMS_PER_SM))


def resident_programs(spec, head_dim: int) -> int | None:
    """RESIDENT_PROGRAMS for the Gluon decode kernel of format `spec` (a KVFormat) at `head_dim` (None where not
    measured: other head_dims, `off`'s four-warp programs, TurboQuant quantizers other than the table's)."""
    if head_dim != 128:
        return None
    if spec.kind == "turboquant":
        return RESIDENT_PROGRAMS.get((spec.k_quant, spec.v_quant))
    return RESIDENT_PROGRAMS.get(spec.mode) if spec.kind == "kvquant" else None


def launcher(fmt, query: torch.Tensor, block_size: int, kernels=DEFAULT_KERNELS, **options):
    """(launcher, programs per multiprocessor its split count aims at) of the Gluon kernel for this decode
    when its format is in `kernels` (default: those that serve, DEFAULT_KERNELS; benchmarks pass KERNELS) and the
    kernel reads it (`supports`, `supports_q4`, `supports_q6`, `supports_tq`, `supports_dense`; options: softcap,
    sliding_window, window), else None. With a window only the formats in WINDOW_KERNELS from WINDOW_MIN_TOKENS
    query tokens on."""
    if options.get("window") is not None:
        if query.shape[0] < WINDOW_MIN_TOKENS:
            return None
        kernels = [name for name in kernels if name in WINDOW_KERNELS]
    for name in kernels:
        reads, launch = KERNELS[name]
        if reads(fmt, query, block_size, **options):
            return launch, tq_tuning(fmt.spec)[1] if name == "turboquant" else PROGRAMS_PER_SM
    return None
