"""Split-K paged attention for few, long sequences: each (query block, KV head) is spread over
num_splits key ranges, then a reduce kernel merges the partial softmax states.

Grid of the split kernel: (query blocks, KV heads, num_splits), sized like `attention.py` from tensor
shapes. Each split covers ceil(seq_len / num_splits) keys (rounded up to a tile), computed on the
device from `seq_lens`, so the work stays even whatever the lengths and the launch stays capturable.
Partial states: out [num_tokens, num_q_heads, num_splits, head_dim] (unnormalised, float32), and the
running max (log2 units) and sum [num_tokens, num_q_heads, num_splits].
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ...formats.base import PageFormat
from ..metadata import AttentionMetadata
from .attention import PER_STEP_ARGS, check_inputs, dot_precision, launch_args, query_block_rows
from .page_view import page_view, ring_pages, stride3
from .decode_io import attend_ring, token_sequence
from .codecs import fwht
from .gluon_support import compiled, gluon_available
from .tiles import attend_range, load_queries
from .tuning import TileConfig, choose_tiles, page_class


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def split_attention_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, q_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr, q_rotation_ptr, out_rotation_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_bt,
    k_strides, v_strides, ks_strides, vs_strides,
    num_seqs, num_splits, qk_scale, softcap, sliding_window,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    KIND: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, ROTATE_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, first, context, token, head, row_ok = query_block_rows(
        q_block, kv_head, query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q)
    if first >= q_len:
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_rows = (q_start + token).to(tl.int64)
    q = load_queries(q_ptr, q_rows, head, row_ok, stride_qt, stride_qh, q_rotation_ptr,
                     HEAD_DIM, HEAD_DIM_PAD, ROTATE_Q, DOT_PRECISION, KIND)
    q_pos = context + token
    chunk = tl.cdiv(tl.cdiv(context + q_len, num_splits), TILE_N) * TILE_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, context + tl.minimum(first + BLOCK_Q, q_len))
    if USE_WINDOW:
        kv_lo = tl.maximum(kv_lo, tl.maximum(context + first - sliding_window + 1, 0) // TILE_N * TILE_N)

    head_off = kv_head.to(tl.int64)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = attend_range(
        q, acc, m_i, l_i, q_pos, kv_lo, kv_hi, context + first, context + tl.minimum(first + BLOCK_Q, q_len) - 1,
        block_table_ptr + seq.to(tl.int64) * stride_bt,
        k_ptr + head_off * k_strides[2], v_ptr + head_off * v_strides[2],
        ks_ptr + head_off * ks_strides[2], kz_ptr + head_off * ks_strides[2], vs_ptr + head_off * vs_strides[2],
        codebook_ptr, (k_strides[0], k_strides[1]), (v_strides[0], v_strides[1]),
        (ks_strides[0], ks_strides[1]), (vs_strides[0], vs_strides[1]),
        qk_scale, softcap, sliding_window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, KIND, K_BITS, V_BITS, DOT_PRECISION)

    state = (q_rows * NUM_Q_HEADS + head) * num_splits + split          # [BLOCK_M] row of the partial states
    tl.store(part_m_ptr + state, m_i, mask=row_ok)
    tl.store(part_l_ptr + state, l_i, mask=row_ok)
    tl.store(part_out_ptr + state[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def reduce_splits_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, signs_ptr,
    stride_ot, stride_oh, num_splits,
    SPLITS_PAD: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ROTATE_OUT: tl.constexpr, PLAIN_LAST: tl.constexpr, LOG2_HEAD_DIM: tl.constexpr, SQRT_HEAD_DIM: tl.constexpr,
    CHANNELS: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (query token, query head, CHANNELS channels): every split's partial state read at once (all
    HEAD_DIM_PAD channels in one program, or a share of them where the grid is small). ROTATE_OUT: the
    merged row is rotated back by the values' Walsh-Hadamard rotation (`hadamard.unrotate`: the butterflies in
    registers, then the signs; no matrix read). PLAIN_LAST: the last slot is in the output's domain, so it is
    added after the rotation. PDL: launched as a programmatic dependent (`dependent_launch`), so it first waits for
    the kernels before it."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.program_id(2) * CHANNELS + tl.arange(0, CHANNELS)
    state0 = (token * NUM_Q_HEADS + head) * num_splits
    s_ok = offs_s < num_splits
    m = tl.load(part_m_ptr + state0 + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + state0 + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)                                               # [SPLITS_PAD]
    total = tl.sum(w * l, axis=0)
    w = w / tl.where(total > 0, total, 1.0)
    part = tl.load(part_out_ptr + (state0 + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None],
                   other=0.0)
    if PLAIN_LAST:
        last = offs_s == num_splits - 1
        share = tl.sum(part * tl.where(last, w, 0.0)[:, None], axis=0)         # [HEAD_DIM_PAD]
        w = tl.where(last, 0.0, w)
    out = tl.sum(part * w[:, None], axis=0)                                   # [HEAD_DIM_PAD]
    if ROTATE_OUT:   # HEAD_DIM_PAD == HEAD_DIM == CHANNELS (a power of two)
        out = tl.sum(fwht(out[None, :], HEAD_DIM, LOG2_HEAD_DIM), axis=0) * (tl.load(signs_ptr + offs_d) / SQRT_HEAD_DIM)
        if PLAIN_LAST:
            out += share
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# Warps of `ring_partial_kernel`, each attending its own 16 keys of the window a step: 4 and 8 were slower than one
# at 32 sequences and more (H200, window of 128: q8 at (128, 2048) 188 and 267 us against 158), faster only for
# one sequence (36.6 against 39.5 us), which `decode_gluon.WINDOW_MIN_TOKENS` leaves to `decode.py`
RING_WARPS = 1
# Keys a step and the loads' pipeline stages of its loop: timed on an H200 (`bench/profile_decode.py --recent-tokens
# 128`, 2026-12-04), us for K q4_0 / V q4_0 at (64, 8192), TurboQuant at (32, 4096), q4 at (128, 2048): 16 keys in 1
# / 2 / 3 stages 18.3 / 15.0 / 15.5, 17.8 / 12.9 / 14.1, 23.8 / 21.7 / 23.2; 32 keys in 2 stages 14.4, 12.5, 23.1,
# in 3 22.9, 19.9, 34.2; 64 keys slower still
RING_TILE_N = 16
RING_STAGES = 2


@triton.jit(do_not_specialize=["num_seqs", "num_slots"])
def ring_partial_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, q_ptr, rk_ptr, rv_ptr, ring_rows_ptr, ring_first_ptr,
    query_start_loc_ptr, seq_lens_ptr, stride_qt, stride_qh, r_strides, num_seqs, num_slots, qk_scale,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_RING_BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RING_WARPS: tl.constexpr, RING_TILE_N: tl.constexpr, RING_STAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    """A dense recent window as the last split: one program per (query token, KV head) attends the keys its
    sequence's ring holds up to the query's position (`decode_io.attend_ring`, as the tile-language decode kernel
    does) and writes its partial state to slot num_slots - 1 (`partial_states`); the pages' splits hold the keys
    before it. Its output stays in the output's domain even where the pages' values accumulate rotated
    (TurboQuant): `reduce_splits(..., plain_last=True)` adds it after rotating the rest back.

    PDL: launched as a programmatic dependent of the page kernel (`dependent_launch`), whose output it does not read:
    its programs run beside the page kernel's last ones, and wait for that kernel only at the end, so that the
    reduce after it, which waits for this kernel, sees the pages' splits too."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = token_sequence(token, query_start_loc_ptr, num_seqs)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_pos = tl.load(seq_lens_ptr + seq) - (tl.load(query_start_loc_ptr + seq + 1) - q_start) + (token - q_start)
    offs_h = tl.arange(0, ROWS)
    h_ok = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    m_i = tl.full([RING_WARPS, ROWS], float("-inf"), tl.float32)    # each warp on its own 16 keys a step
    l_i = tl.zeros([RING_WARPS, ROWS], tl.float32)
    acc, m_i, l_i, _ = attend_ring(
        seq, token, kv_head, head, h_ok, 0, q_pos + 1, m_i, l_i, q_ptr, rk_ptr, rv_ptr, ring_rows_ptr,
        ring_first_ptr, stride_qt, stride_qh, r_strides, qk_scale, 1.0, HEAD_DIM, HEAD_DIM, BLOCK_SIZE,
        NUM_RING_BLOCKS, False, DOT_PRECISION, RING_TILE_N, RING_STAGES)
    offs_d = tl.arange(0, HEAD_DIM)
    out = tl.trans(acc)                                                                 # [ROWS, HEAD_DIM]
    state = (token.to(tl.int64) * NUM_Q_HEADS + head) * num_slots + num_slots - 1
    tl.store(part_m_ptr + state, tl.max(m_i, axis=0), mask=h_ok)
    tl.store(part_l_ptr + state, tl.sum(l_i, axis=0), mask=h_ok)
    tl.store(part_out_ptr + state[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None])
    if PDL:
        tl.extra.cuda.gdc_wait()


def ring_partials(query: torch.Tensor, view, meta: AttentionMetadata, window, parts, scale: float, precision: str):
    """The dense recent window `window` (rings of keys and values, `decode.paged_attention`'s argument, planned in
    `meta.window`) attended as the last split of `parts` (`partial_states`, head_dim_pad = head_dim): the page
    kernel's splits must stop where each sequence's ring begins, and `reduce_splits` merge with plain_last=True
    (the window's share is not in TurboQuant's rotated domain): `reduce_with_window` does both."""
    plan = meta.window
    rk, rv = ring_pages(view, meta, window)
    part_out, part_m, part_l = parts
    num_tokens, num_q_heads, num_slots, head_dim = part_out.shape
    assert head_dim == view.head_dim, "the ring's partial states are written unpadded"
    group = num_q_heads // view.num_kv_heads
    ring_partial_kernel[(num_tokens, view.num_kv_heads)](
        part_out, part_m, part_l, query, rk, rv, plan.rows, plan.first_block, meta.query_start_loc, meta.seq_lens,
        query.stride(0), query.stride(1), stride3(rk), meta.block_table.shape[0], num_slots, float(scale),
        NUM_Q_HEADS=num_q_heads, GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=meta.block_size, NUM_RING_BLOCKS=plan.num_ring_blocks, DOT_PRECISION=precision,
        RING_WARPS=RING_WARPS, RING_TILE_N=RING_TILE_N, RING_STAGES=RING_STAGES, num_warps=RING_WARPS,
        **dependent_options(query.device))


def reduce_with_window(out: torch.Tensor, parts, query: torch.Tensor, view, meta: AttentionMetadata, window,
                       scale: float, precision: str) -> None:
    """The end of a split decode over pages: the dense recent window `window`, if any, attended into the last
    slot of `parts` (`ring_partials`), then every slot merged into out (`reduce_splits`, the window's share added
    after the rotation back). parts None (one split, no window): the page kernel wrote out itself."""
    if parts is None:
        return
    if window is not None:
        ring_partials(query, view, meta, window, parts, scale, precision)
    reduce_splits(out, parts, view, plain_last=window is not None)


# Programmatic dependent launch of the kernels that end a split decode (the window's, the reduce): each is staged
# while the kernel before it runs, whose programs let it start as they begin (`decode_gluon.launch_dependents`).
PDL = True


def dependent_launch(device: torch.device) -> bool:
    """Whether the kernels after a split decode's page kernel are launched as programmatic dependents: PDL, and
    compiled for a GPU of compute capability 9.0 or newer (`griddepcontrol`) by a Triton that launches so (3.6 or
    newer, as the Gluon kernels need; `gluon_support.gluon_available`). Asked at every launch of those kernels."""
    return (PDL and device.type == "cuda" and compiled()
            and _pdl_device(device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    return gluon_available() and torch.cuda.get_device_capability(index)[0] >= 9


def dependent_options(device: torch.device) -> dict:
    """Launch options and the kernel's PDL switch for a kernel that ends a split decode (`dependent_launch`)."""
    return {"PDL": True, "launch_pdl": True} if dependent_launch(device) else {}


def partial_states(query: torch.Tensor, num_splits: int, head_dim_pad: int):
    """Buffers for the splits' partial states of queries [num_tokens, num_q_heads, head_dim]: out
    [num_tokens, num_q_heads, num_splits, head_dim_pad], max and sum [num_tokens, num_q_heads, num_splits]
    (float32)."""
    num_tokens, num_q_heads, _ = query.shape
    part_out = torch.empty(num_tokens, num_q_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device)
    part_m = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    return part_out, part_m, torch.empty_like(part_m)


# Warps of `reduce_splits_kernel`, one program per (query token, query head): one while the partial states it
# reads are at most REDUCE_ONE_WARP_ELEMENTS floats (16 slots of 128 channels), else four. Timed on an H200
# (`bench/profile_decode.py`, Llama-3-8B heads, 2026-12-04), us per call with 4 / 2 / 1 warps: K q4_0 / V q4_0 at
# (64, 8192) with a window of 128 (5 slots) 13.3 / 5.8 / 3.6, at (32, 4096) (9 slots) 8.2 / 4.3 / 3.2; q4 7.1 /
# 3.5 / 2.7; `off` at (32, 4096) (4 slots) 4.2 / 2.5 / 1.9; but one sequence of 32,768 tokens (128 slots) 2.7 / 2.9
# / 17.1 (`off`), where one warp holds 512 floats a lane
REDUCE_WARPS = 4
REDUCE_ONE_WARP_ELEMENTS = 16 * 128
# Channels a reduce program merges where its (query token, query head) programs are fewer than REDUCE_SMALL_GRID
# (one sequence: 32 programs), formats whose output is not rotated back: smaller shares spread the reads over more
# multiprocessors. Timed on an H200 (2026-12-04, time / SDPA, two runs each, 128 / 64 / 32 / 16 channels): one
# sequence of 32,768 tokens `off` 1.020-1.032 / 1.015-1.017 / 1.013-1.015 / 1.010-1.011, q8 0.699-0.707 / 0.693 /
# 0.692 / 0.685, q4 0.534-0.539 / 0.527-0.530 / 0.523-0.528 / 0.515-0.524, q6 0.676-0.690 / 0.667-0.672 /
# 0.661-0.665 / 0.660-0.661; two of 16,384 tokens within 1% either way
REDUCE_CHANNELS = 16
REDUCE_SMALL_GRID = 128


def reduce_splits(out: torch.Tensor, parts, view, *, plain_last: bool = False) -> None:
    """Merge the partial states `parts` (`partial_states`) into out [num_tokens, num_q_heads, head_dim],
    rotating back when the format accumulates values in a rotated domain (`view.rotate_out`). `plain_last`: the
    last slot (a dense window's, `ring_partials`) is already in the output's domain, so it is added after the
    rotation instead of rotated with the rest."""
    part_out, part_m, part_l = parts
    num_tokens, num_q_heads, num_splits, head_dim_pad = part_out.shape
    head_dim = out.shape[-1]
    rotate = bool(view.rotate_out)
    assert not rotate or head_dim == head_dim_pad == 1 << (head_dim.bit_length() - 1), \
        f"the rotation back needs a power-of-two head_dim, got {head_dim}"
    splits_pad = triton.next_power_of_2(num_splits)
    channels = head_dim_pad
    if not rotate and num_tokens * num_q_heads < REDUCE_SMALL_GRID:
        channels = min(head_dim_pad, REDUCE_CHANNELS)
    reduce_splits_kernel[(num_tokens, num_q_heads, head_dim_pad // channels)](
        out, part_out, part_m, part_l, view.aux("value_signs") if rotate else part_m, out.stride(0), out.stride(1),
        num_splits, SPLITS_PAD=splits_pad, NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, ROTATE_OUT=rotate, PLAIN_LAST=plain_last and rotate,
        LOG2_HEAD_DIM=head_dim.bit_length() - 1, SQRT_HEAD_DIM=math.sqrt(head_dim),
        CHANNELS=channels, num_warps=1 if splits_pad * channels <= REDUCE_ONE_WARP_ELEMENTS else REDUCE_WARPS,
        **dependent_options(out.device),
    )


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    num_splits: int = 8, tiles: TileConfig | None = None) -> torch.Tensor:
    """Same contract as `reference.paged_attention`, computed as `num_splits` key ranges plus a reduce."""
    view = page_view(fmt, pages)
    check_inputs(query, view, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = meta.block_table.shape[0]
    group = num_q_heads // view.num_kv_heads
    tiles = tiles or choose_tiles(num_tokens, num_seqs, group, head_dim, query.device,
                                  pages=page_class(fmt), dtype=query.dtype)
    block_q = tiles.block_m // group
    head_dim_pad = triton.next_power_of_2(head_dim)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    part_out, part_m, part_l = partial_states(query, num_splits, head_dim_pad)
    grid = (num_tokens // block_q + num_seqs, view.num_kv_heads, num_splits)
    precision = dot_precision(query.dtype)
    split_attention_kernel[grid](
        part_out, part_m, part_l, query, *launch_args(view, query.dtype),
        meta.block_table, meta.seq_lens, meta.query_start_loc,
        query.stride(0), query.stride(1), meta.block_table.stride(0),
        stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale),
        num_seqs, num_splits, float(scale), float(softcap or 1.0), int(sliding_window or 0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=meta.block_size,
        BLOCK_M=tiles.block_m, BLOCK_Q=block_q, TILE_N=tiles.tile_n,
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(sliding_window),
        KIND=view.kind, K_BITS=view.k_bits, V_BITS=view.v_bits, ROTATE_Q=view.rotate_keys, DOT_PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    reduce_splits(out, (part_out, part_m, part_l), view)
    return out
