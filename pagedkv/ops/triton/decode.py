"""Decode attention with one softmax per warp: each warp streams its own keys, no barrier per tile.

The varlen kernel's 16-row tile spreads one key tile over its 4 warps: every step then reduces the
row max and sum across warps through shared memory (5 barriers per tile) and passes the probabilities
between warps before P.V. Here the tile is 3-D, [WARPS, rows, keys]: `tl.dot` on 3-D operands puts one
batch entry per warp, so warp w keeps its own running max, sum and output for keys
[start + w * TILE_N, start + (w + 1) * TILE_N) and the warps meet once, at the end.

Grid: (query tokens, KV heads, splits). A program owns one query token and the GROUP query heads of one
KV head (rows, padded to 16 for the matrix units), so it serves decode, speculative verification and
any other varlen batch exactly (each token finds its sequence by a binary search over
`query_start_loc`, and sees keys up to its own position). With splits > 1 each split covers an even
share of the token's keys and writes a partial state for `split_k.reduce_splits_kernel`.

Formats (compile-time `KIND`, `K_BITS`):
  DENSE          pages as stored (queries and pages share a dtype).
  KVQUANT q8     int8 codes; the products run in float16 (codes are exact there) and the per-token
                 scales multiply score and probability columns.
  KVQUANT q4/q6  read as int16 units of four channels (q6: plus one byte of its 2-bit plane), one product
                 per channel of a unit, so no code is ever moved to its channel ("split dot"); q8 values
                 as int16 pairs of channels the same way. The output's channels are stored apart.
  TURBOQUANT     int8 keys (q8_0): one product per group of 32 channels, the group's scale and zero
                 point applied to score columns; 3-bit values (code nibbles in units of eight channels,
                 `packing.pack_code_nibbles`): eight products per step, each over 16 channels of one
                 group, whose scale goes on the probability columns; the output is rotated back at the end
                 (split-K: by the reduce kernel). Rotated keys: the queries are rotated before the
                 kernel. head_dim 128; q4_0 keys and 4-bit values in the transposed kernel (`is_supported`).
`decode_transposed.py` is the same kernel with keys on the matrix units' M dimension, faster for every
quantized format (`tuning.warp_split_tiles` chooses it); this orientation stays for comparison and tests.
Codes become float16 with byte permutes (under the exponent of 1024, or into the fp16 codebook) in inline
PTX (`FAST_CVT`), or with plain conversions under the interpreter, which cannot run PTX: the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.base import PageFormat
from ..metadata import AttentionMetadata
from .attention import check_inputs, dot_precision
from .codecs import KVQUANT, TURBOQUANT
from .conversions import code_nibbles_to_f16, int8_pairs_to_f16, int8_to_f16
from .decode_io import (attend_ring, launch_grid, load_quads, load_rows, program_coords, ring_accumulators,
                        token_sequence)
from .decode_transposed import decode_kernel_transposed
from .gluon_support import compiled
from .page_view import page_view, ring_pages, stride3, value_codebook
from .tiles import LOG2E, tanh
from .tuning import DecodeTiles, warp_split_tiles

# Integer arguments that change from step to step (see attention.PER_STEP_ARGS).
PER_STEP_ARGS = ["num_seqs", "stride_bt", "num_splits"]


def is_supported(fmt: PageFormat, transposed: bool = True) -> bool:
    """Formats this kernel reads: dense pages, KV-Quant, and TurboQuant at head_dim 128 with q8_0 keys and 3-bit
    values, or in the transposed orientation (`decode_transposed.py`, the default) q8_0 or q4_0 keys and 3- or
    4-bit values; keys rotated or not (the queries are rotated instead). Other TurboQuant pages use the varlen
    kernels. (The fp16 look-up tables are the Lloyd-Max codebooks: `conversions.py`.)"""
    kind = fmt.spec.kind
    if kind == "turboquant":
        bits = (fmt.key_bits, fmt.value_bits)
        return fmt.head_dim == 128 and (bits == (8, 3) or (transposed and bits[0] in (4, 8) and bits[1] in (3, 4)))
    return kind == "dense" or kind == "kvquant"


@triton.jit
def tq_key_group(q_g, qsum_g, k_ptr, ks_ptr, kz_ptr, k_row, s_row, ok, offs32, G: tl.constexpr,
                 CDTYPE: tl.constexpr, FAST_CVT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores [WARPS, ROWS, TILE_N] of TurboQuant int8 keys' channel group G (32 channels):
    scale * (q_g . codes) + zero * scale * sum(q_g), the group's scale and zero applied to score columns."""
    codes = int8_to_f16(load_rows(k_ptr + 32 * G, k_row, offs32, ok), FAST_CVT).to(CDTYPE)
    d = tl.dot(q_g, tl.trans(codes, (0, 2, 1)), input_precision=DOT_PRECISION)
    sc = tl.load(ks_ptr + s_row + G, mask=ok, other=0.0).to(tl.float32)
    zs = tl.load(kz_ptr + s_row + G, mask=ok, other=0.0).to(tl.float32) * sc
    return d * sc[:, None, :] + zs[:, None, :] * qsum_g[:, :, None]


@triton.jit
def query_columns(q_row, row_ok, cols, WARPS: tl.constexpr, CDTYPE: tl.constexpr):
    """Channels `cols` [C] of the query rows q_row [ROWS, 1] in CDTYPE, broadcast to every warp: [WARPS, ROWS, C]."""
    q = tl.load(q_row + cols[None, :], mask=row_ok[:, None], other=0.0).to(CDTYPE)
    return tl.broadcast_to(q[None, :, :], [WARPS, q.shape[0], q.shape[1]])


@triton.jit
def query_group(q_row, row_ok, offs32, G: tl.constexpr, WARPS: tl.constexpr, CDTYPE: tl.constexpr):
    """Channels 32G..32G+31 of the query rows, broadcast to every warp, and their sums: ([WARPS, ROWS, 32], [WARPS, ROWS])."""
    q = query_columns(q_row, row_ok, 32 * G + offs32, WARPS, CDTYPE)
    return q, tl.sum(q.to(tl.float32), axis=2)


@triton.jit
def rotate_channel(out_j, rotation_ptr, J: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out_j [ROWS, HEAD_DIM // 8] (channels J * HEAD_DIM / 8 + u) @ those rows of rotation [HEAD_DIM, HEAD_DIM]:
    [ROWS, HEAD_DIM]."""
    offs_u = tl.arange(0, HEAD_DIM // 8)
    offs_d = tl.arange(0, HEAD_DIM)
    r = tl.load(rotation_ptr + (J * (HEAD_DIM // 8) + offs_u)[:, None] * HEAD_DIM + offs_d[None, :])
    return tl.dot(out_j, r, input_precision=DOT_PRECISION)


@triton.jit
def merge_warps(acc, f, inv):
    """acc [WARPS, ROWS, C] partial outputs with weights f [WARPS, ROWS] -> [ROWS, C] scaled by inv [ROWS]."""
    return tl.sum(acc * f[:, :, None], axis=0) * inv[:, None]


@triton.jit
def store_channels(o_row, cols, acc, f, inv, mask):
    """Merge the warps' partial outputs acc [WARPS, ROWS, C] (weights f [WARPS, ROWS]), scale rows by inv
    [ROWS] and store them at o_row [ROWS, 1] + cols [C]."""
    tl.store(o_row + cols[None, :], merge_warps(acc, f, inv).to(o_row.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def decode_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, q_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr, rotation_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, token_order_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    k_strides, v_strides, ks_strides, vs_strides,   # (block, slot, head) of each page tensor
    rq_ptr, rk_ptr, rv_ptr, ring_rows_ptr, ring_first_ptr, stride_rqt, stride_rqh, r_strides,   # RING: `attend_ring`
    num_seqs, num_splits, qk_scale, softcap, sliding_window,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    WARPS: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, KIND: tl.constexpr, K_BITS: tl.constexpr,
    FAST_CVT: tl.constexpr, DOT_PRECISION: tl.constexpr, RING: tl.constexpr, NUM_RING_BLOCKS: tl.constexpr,
    ORDERED: tl.constexpr = False,
):
    token, kv_head, split = program_coords(token_order_ptr, ORDERED)
    seq = token_sequence(token, query_start_loc_ptr, num_seqs)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_pos = tl.load(seq_lens_ptr + seq) - q_len + (token - q_start)   # keys [0, q_pos] are visible

    offs_r = tl.arange(0, ROWS)
    row_ok = offs_r < GROUP
    head = kv_head * GROUP + offs_r                                      # [ROWS] query heads
    q_row = q_ptr + token.to(tl.int64) * stride_qt + head[:, None] * stride_qh
    QUANT: tl.constexpr = KIND == KVQUANT
    TQ: tl.constexpr = KIND == TURBOQUANT      # int8 keys, 3-bit values, head_dim 128 (`is_supported`)
    tl.static_assert(not TQ or HEAD_DIM == 128, "TurboQuant decode: head_dim 128 (four 32-channel groups)")
    # KV-Quant values are read as int16 units of NV channels (q8: 2; q4, q6: 4), one product per channel of
    # a unit; q4 / q6 keys too (KU)
    NV: tl.constexpr = (2 if K_BITS == 8 else 4) if QUANT else 1
    KU: tl.constexpr = QUANT and K_BITS != 8
    CDTYPE: tl.constexpr = tl.float32 if q_ptr.dtype.element_ty == tl.float32 else (
        tl.float16 if QUANT or TQ else q_ptr.dtype.element_ty)
    offs_c = tl.arange(0, HEAD_DIM_PAD)
    q_a = tl.load(q_row + offs_c[None, :], mask=row_ok[:, None] & (offs_c < HEAD_DIM)[None, :], other=0.0)
    q_a = tl.broadcast_to(q_a.to(CDTYPE)[None, :, :], [WARPS, ROWS, HEAD_DIM_PAD])
    VC: tl.constexpr = HEAD_DIM // 8 if TQ else (HEAD_DIM // NV if QUANT else 16)
    offs_u = tl.arange(0, VC)
    if KU:   # the query's channels 4u + i, i = 0..3
        q0 = query_columns(q_row, row_ok, 4 * offs_u, WARPS, CDTYPE)
        q1 = query_columns(q_row, row_ok, 4 * offs_u + 1, WARPS, CDTYPE)
        q2 = query_columns(q_row, row_ok, 4 * offs_u + 2, WARPS, CDTYPE)
        q3 = query_columns(q_row, row_ok, 4 * offs_u + 3, WARPS, CDTYPE)

    if TQ:   # the query's channel groups of 32 and their sums (the keys' zero points apply to them)
        offs32 = tl.arange(0, 32)
        qg0, qs0 = query_group(q_row, row_ok, offs32, 0, WARPS, CDTYPE)
        qg1, qs1 = query_group(q_row, row_ok, offs32, 1, WARPS, CDTYPE)
        qg2, qs2 = query_group(q_row, row_ok, offs32, 2, WARPS, CDTYPE)
        qg3, qs3 = query_group(q_row, row_ok, offs32, 3, WARPS, CDTYPE)
        V_ASM: tl.constexpr = FAST_CVT and CDTYPE == tl.float16   # the look-up asm builds float16 values

    # this split's keys: an even share, whole warp tiles
    STEP: tl.constexpr = WARPS * TILE_N
    chunk = tl.cdiv(tl.cdiv(q_pos + 1, num_splits), STEP) * STEP
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, q_pos + 1)
    first = kv_lo
    if USE_WINDOW:
        first = tl.maximum(kv_lo, q_pos - sliding_window + 1)
        kv_lo = tl.maximum(kv_lo, first // STEP * STEP)

    head_off = kv_head.to(tl.int64)
    k_ptr += head_off * k_strides[2]
    v_ptr += head_off * v_strides[2]
    ks_ptr += head_off * ks_strides[2]
    kz_ptr += head_off * ks_strides[2]   # k_zero shares k_scale's layout (`page_view`)
    vs_ptr += head_off * vs_strides[2]
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    pos0 = tl.arange(0, WARPS)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]   # [WARPS, TILE_N]

    acc_a = tl.zeros([WARPS, ROWS, HEAD_DIM_PAD], dtype=tl.float32)   # dense pages
    acc0 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)     # value units: channel NV * u + i in acc<i>
    acc1 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)
    acc2 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)
    acc3 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)
    acc4 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)     # TurboQuant: eight channels per unit
    acc5 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)
    acc6 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)
    acc7 = tl.zeros([WARPS, ROWS, VC], dtype=tl.float32)
    m_i = tl.full([WARPS, ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([WARPS, ROWS], dtype=tl.float32)
    body_hi = kv_hi
    if RING:   # the keys the dense recent window holds first, then their output in the accumulators' channels
        acc_r, m_i, l_i, body_hi = attend_ring(
            seq, token, kv_head, head, row_ok, first, kv_hi, m_i, l_i, rq_ptr, rk_ptr, rv_ptr, ring_rows_ptr,
            ring_first_ptr, stride_rqt, stride_rqh, r_strides, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, NUM_RING_BLOCKS, USE_SOFTCAP, DOT_PRECISION)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_a = ring_accumulators(
            acc_r, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_a, offs_u, rotation_ptr, TQ, NV, HEAD_DIM,
            DOT_PRECISION, WARPS, False)
    for start in range(kv_lo, body_hi, STEP):   # the pages' keys
        offs_n = start + pos0
        ok = (offs_n < body_hi) & (offs_n >= first)
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k_row = block * k_strides[0] + slot * k_strides[1]
        v_row = block * v_strides[0] + slot * v_strides[1]
        if TQ:
            s_row = block * ks_strides[0] + slot * ks_strides[1]
            s = tq_key_group(qg0, qs0, k_ptr, ks_ptr, kz_ptr, k_row, s_row, ok, offs32, 0, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq_key_group(qg1, qs1, k_ptr, ks_ptr, kz_ptr, k_row, s_row, ok, offs32, 1, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq_key_group(qg2, qs2, k_ptr, ks_ptr, kz_ptr, k_row, s_row, ok, offs32, 2, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq_key_group(qg3, qs3, k_ptr, ks_ptr, kz_ptr, k_row, s_row, ok, offs32, 3, CDTYPE, FAST_CVT, DOT_PRECISION)
        elif KU:
            k0, k1, k2, k3 = load_quads(k_ptr, k_row, offs_u, ok, K_BITS, HEAD_DIM, FAST_CVT)
            s = tl.dot(q0, tl.trans(k0.to(CDTYPE), (0, 2, 1)), input_precision=DOT_PRECISION)
            s = tl.dot(q1, tl.trans(k1.to(CDTYPE), (0, 2, 1)), s, input_precision=DOT_PRECISION)
            s = tl.dot(q2, tl.trans(k2.to(CDTYPE), (0, 2, 1)), s, input_precision=DOT_PRECISION)
            s = tl.dot(q3, tl.trans(k3.to(CDTYPE), (0, 2, 1)), s, input_precision=DOT_PRECISION)
        elif QUANT:
            k = int8_to_f16(load_rows(k_ptr, k_row, offs_c, ok), FAST_CVT).to(CDTYPE)
            s = tl.dot(q_a, tl.trans(k, (0, 2, 1)), input_precision=DOT_PRECISION)
        else:
            k = tl.load(k_ptr + k_row[:, :, None] + offs_c[None, None, :],
                        mask=ok[:, :, None] & (offs_c < HEAD_DIM)[None, None, :], other=0.0)
            s = tl.dot(q_a, tl.trans(k.to(CDTYPE), (0, 2, 1)), input_precision=DOT_PRECISION)   # [WARPS, ROWS, TILE_N]
        if QUANT:
            s = s * tl.load(ks_ptr + block * ks_strides[0] + slot * ks_strides[1], mask=ok, other=0.0)[:, None, :]
        if USE_SOFTCAP:
            s = softcap * tanh(s * (qk_scale / softcap)) * LOG2E
        else:
            s = s * (qk_scale * LOG2E)
        s = tl.where(ok[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, :, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=2)
        if QUANT:
            p = p * tl.load(vs_ptr + block * vs_strides[0] + slot * vs_strides[1], mask=ok, other=0.0)[:, None, :]
        p_f = p
        p = p.to(CDTYPE)
        if TQ:
            units = load_rows(v_ptr.to(tl.pointer_type(tl.int16)), v_row // 2, offs_u, ok)   # M words
            bytes_n = load_rows(v_ptr + HEAD_DIM // 4, v_row, offs_u, ok)                    # N bytes
            # field j of every unit is channels [16 j, 16 j + 16): group j // 2, whose scale goes on P's columns
            v0, v1, v2, v3, v4, v5, v6, v7 = code_nibbles_to_f16(units, bytes_n, codebook_ptr, V_ASM)
            v_s_row = block * vs_strides[0] + slot * vs_strides[1]
            p0 = (p_f * tl.load(vs_ptr + v_s_row, mask=ok, other=0.0).to(tl.float32)[:, None, :]).to(CDTYPE)
            p1 = (p_f * tl.load(vs_ptr + v_s_row + 1, mask=ok, other=0.0).to(tl.float32)[:, None, :]).to(CDTYPE)
            p2 = (p_f * tl.load(vs_ptr + v_s_row + 2, mask=ok, other=0.0).to(tl.float32)[:, None, :]).to(CDTYPE)
            p3 = (p_f * tl.load(vs_ptr + v_s_row + 3, mask=ok, other=0.0).to(tl.float32)[:, None, :]).to(CDTYPE)
            acc0 = tl.dot(p0, v0.to(CDTYPE), acc0 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc1 = tl.dot(p0, v1.to(CDTYPE), acc1 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc2 = tl.dot(p1, v2.to(CDTYPE), acc2 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc3 = tl.dot(p1, v3.to(CDTYPE), acc3 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc4 = tl.dot(p2, v4.to(CDTYPE), acc4 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc5 = tl.dot(p2, v5.to(CDTYPE), acc5 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc6 = tl.dot(p3, v6.to(CDTYPE), acc6 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc7 = tl.dot(p3, v7.to(CDTYPE), acc7 * alpha[:, :, None], input_precision=DOT_PRECISION)
        elif QUANT:
            if NV == 2:
                v0, v1 = int8_pairs_to_f16(load_rows(v_ptr.to(tl.pointer_type(tl.int16)), v_row // 2, offs_u, ok), FAST_CVT)
            else:
                v0, v1, v2, v3 = load_quads(v_ptr, v_row, offs_u, ok, K_BITS, HEAD_DIM, FAST_CVT)
                acc2 = tl.dot(p, v2.to(CDTYPE), acc2 * alpha[:, :, None], input_precision=DOT_PRECISION)
                acc3 = tl.dot(p, v3.to(CDTYPE), acc3 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc0 = tl.dot(p, v0.to(CDTYPE), acc0 * alpha[:, :, None], input_precision=DOT_PRECISION)
            acc1 = tl.dot(p, v1.to(CDTYPE), acc1 * alpha[:, :, None], input_precision=DOT_PRECISION)
        else:
            v = tl.load(v_ptr + v_row[:, :, None] + offs_c[None, None, :],
                        mask=ok[:, :, None] & (offs_c < HEAD_DIM)[None, None, :], other=0.0)
            acc_a = tl.dot(p, v.to(CDTYPE), acc_a * alpha[:, :, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # the warps meet: one softmax state per row
    m = tl.max(m_i, axis=0)                                                   # [ROWS]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    f = tl.math.exp2(m_i - m_safe[None, :])                                   # [WARPS, ROWS]
    l = tl.sum(l_i * f, axis=0)
    if SPLIT:
        state = (token.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + state, m, mask=row_ok)
        tl.store(part_l_ptr + state, l, mask=row_ok)
        o_row = part_out_ptr + state[:, None] * HEAD_DIM_PAD
        inv = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        o_row = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh
        inv = 1.0 / tl.where(l > 0, l, 1.0)
    rows = row_ok[:, None]
    if TQ and not SPLIT:   # rotate the output back: out = out_rot @ rotation, one product per channel of a unit
        out = rotate_channel(merge_warps(acc0, f, inv), rotation_ptr, 0, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc1, f, inv), rotation_ptr, 1, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc2, f, inv), rotation_ptr, 2, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc3, f, inv), rotation_ptr, 3, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc4, f, inv), rotation_ptr, 4, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc5, f, inv), rotation_ptr, 5, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc6, f, inv), rotation_ptr, 6, HEAD_DIM, DOT_PRECISION)
        out += rotate_channel(merge_warps(acc7, f, inv), rotation_ptr, 7, HEAD_DIM, DOT_PRECISION)
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(o_row + offs_d[None, :], out.to(o_row.dtype.element_ty), mask=rows)
    elif TQ:               # partial states stay in the rotated domain; the reduce kernel rotates
        store_channels(o_row, offs_u, acc0, f, inv, rows)
        store_channels(o_row, VC + offs_u, acc1, f, inv, rows)
        store_channels(o_row, 2 * VC + offs_u, acc2, f, inv, rows)
        store_channels(o_row, 3 * VC + offs_u, acc3, f, inv, rows)
        store_channels(o_row, 4 * VC + offs_u, acc4, f, inv, rows)
        store_channels(o_row, 5 * VC + offs_u, acc5, f, inv, rows)
        store_channels(o_row, 6 * VC + offs_u, acc6, f, inv, rows)
        store_channels(o_row, 7 * VC + offs_u, acc7, f, inv, rows)
    elif QUANT:
        store_channels(o_row, NV * offs_u, acc0, f, inv, rows)
        store_channels(o_row, NV * offs_u + 1, acc1, f, inv, rows)
        if NV == 4:
            store_channels(o_row, NV * offs_u + 2, acc2, f, inv, rows)
            store_channels(o_row, NV * offs_u + 3, acc3, f, inv, rows)
    else:
        store_channels(o_row, offs_c, acc_a, f, inv, rows & (offs_c < HEAD_DIM)[None, :])


def check_scale_words(view) -> None:
    """TurboQuant decode reads each slot's four fp16 group scales (and zero points) as one 8-byte word."""
    for t in (view.k_scale, view.k_zero, view.v_scale):
        if t.data_ptr() % 8 or any(st % 4 for st in t.stride()[:3]):
            raise ValueError("TurboQuant decode reads each slot's four fp16 group scales as one 8-byte word: "
                             "scale pages must be 8-byte aligned per slot (as `allocate_pages` makes them), "
                             f"got data_ptr % 8 = {t.data_ptr() % 8}, strides {tuple(t.stride())}")


def ring_args(query: torch.Tensor, view, meta: AttentionMetadata,
              window: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[tuple, dict]:
    """The decode kernels' arguments for a dense recent window (`decode_io.attend_ring`), in kernel order, and
    their compile-time constants; stand-ins, never read, without one."""
    if window is None:
        return (query, view.k, view.k, meta.seq_lens, meta.seq_lens, 0, 0, (0, 0, 0)), dict(RING=False, NUM_RING_BLOCKS=1)
    plan = meta.window
    rk, rv = ring_pages(view, meta, window)
    return ((query, rk, rv, plan.rows, plan.first_block, query.stride(0), query.stride(1), stride3(rk)),
            dict(RING=True, NUM_RING_BLOCKS=plan.num_ring_blocks))



def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    num_splits: int = 1, tiles: DecodeTiles | None = None,
                    window: tuple[torch.Tensor, torch.Tensor] | None = None, ordered: bool | None = None) -> torch.Tensor:
    """Same contract as `reference.paged_attention`, for formats `is_supported` accepts: one program per
    (query token, KV head, split), `tiles.num_warps` warps of `tiles.tile_n` keys each per step, in either
    orientation (default: the format's measured `tuning.warp_split_tiles`).

    `window`: a layer's dense recent window (`pagedkv.window`), its rings of keys and values [num_rows,
    num_ring_blocks, block_size, num_kv_heads, head_dim] (any float dtype), planned in `meta.window`: each
    sequence's blocks from `meta.window.first_block` on are read from its ring row `meta.window.rows`, exact,
    the ones before from the pages, in the same pass (a split may cover both). `ordered`: the launch order
    (`decode_io.launch_grid`: by default `meta.token_order`'s when it has one)."""
    from .split_k import partial_states, reduce_splits

    tiles = tiles or warp_split_tiles(fmt)
    assert is_supported(fmt, tiles.transposed), \
        f"the warp-split decode kernel ({'transposed' if tiles.transposed else 'heads on M'}) does not read {fmt.spec} pages"
    view = page_view(fmt, pages)
    check_inputs(query, view, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = meta.block_table.shape[0]
    group = num_q_heads // view.num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    split = num_splits > 1
    parts = partial_states(query, num_splits, head_dim_pad) if split else (out, out, out)
    precision = dot_precision(query.dtype)
    fast_cvt = compiled()   # inline PTX conversions, except under the interpreter
    extra = {}
    if tiles.transposed:   # the group's heads on the N dimension: 8 columns at least
        kernel, rows = decode_kernel_transposed, max(8, triton.next_power_of_2(group))
        extra["V_BITS"] = view.v_bits if view.kind == TURBOQUANT else 3
        if view.kind == TURBOQUANT:   # the kernel reads a slot's four group scales in one 8-byte load
            check_scale_words(view)
    else:                  # the group's heads on the M dimension: 16 rows at least
        kernel, rows = decode_kernel, max(16, triton.next_power_of_2(group))
    registers = {"maxnreg": tiles.max_registers} if tiles.max_registers else {}
    ring, ring_constants = ring_args(query, view, meta, window)
    q = query
    if view.rotate_keys:   # keys stored rotated (k R): the scores are (q R) . (k R), R orthogonal
        q = (query.float() @ view.q_rotation).to(torch.float32 if query.dtype == torch.float32 else torch.float16)
    grid, order, ordered = launch_grid(query, meta, view.num_kv_heads, num_splits, ordered)
    kernel[grid](
        out, *parts, q, view.k, view.v, view.k_scale, view.k_zero, view.v_scale,
        value_codebook(view, query.dtype), view.aux("out_rotation"),
        meta.block_table, meta.seq_lens, meta.query_start_loc, order,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale), *ring,
        num_seqs, num_splits, float(scale), float(softcap or 1.0), int(sliding_window or 0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, ROWS=rows,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=meta.block_size,
        WARPS=tiles.num_warps, TILE_N=tiles.tile_n, SPLIT=split,
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(sliding_window), KIND=view.kind, K_BITS=view.k_bits,
        FAST_CVT=fast_cvt, DOT_PRECISION=precision, ORDERED=ordered,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **registers, **ring_constants, **extra,
    )
    if split:
        reduce_splits(out, parts, view)
    return out
