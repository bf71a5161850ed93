"""The warp-split decode kernel transposed: keys on the matrix units' M dimension, the GQA group's query
heads on N (S^T = K Q^T, then O^T = V^T P^T).

`decode.py` puts the group's heads on the M dimension, padded to 16 rows: with a group of 4 query heads, 12
of every 16 rows are computed for nothing, in both products, in the softmax and in the accumulators. Here
the heads fill N, padded to 8 columns, so half as many matrix instructions and softmax elements per key,
and half the accumulator registers: capped at 128 registers, 16 warps fit a multiprocessor instead of 8.
The price is P^T, which the second product reads as its B operand: Triton moves it through shared memory.
Measured on an H200 (`bench/kernel_bench.py --warp-split`): TurboQuant 1.11-1.25x and q4 0.96-1.12x faster than
`decode.py`; unpipelined with 32 keys per warp, q8 and q6 too, so it is the default for every quantized
format (`tuning.warp_split_tiles`). Those layout conversions synchronise a program's warps (12-18 barriers
per step), so the default program is a single warp, 16 of them per multiprocessor, split-K filling the GPU;
WARPS > 1 still works (each warp its own keys, merged at the end).

Grid, splits, formats, conversions and partial states are `decode.py`'s; only the orientation differs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codecs import KVQUANT, TURBOQUANT
from .conversions import (code_nibbles_to_f16, int8_pairs_to_f16, int8_to_f16, nibble_pairs_to_f16,
                          nibble_quads_to_f16, sign_nibble_pairs_to_f16, six_bit_quads_to_f16)
from .decode_io import (attend_ring, load_rows, program_coords, ring_accumulators, softmax_step_t,
                        token_sequence, value_channels)


@triton.jit
def query_t(q_row_t, h_ok, cols, WARPS: tl.constexpr, CDTYPE: tl.constexpr):
    """Channels `cols` [C] of the query heads q_row_t [1, HR], transposed and broadcast: [WARPS, C, HR]."""
    q = tl.load(q_row_t + cols[:, None], mask=h_ok[None, :], other=0.0).to(CDTYPE)
    return tl.broadcast_to(q[None, :, :], [WARPS, q.shape[0], q.shape[1]])


@triton.jit
def tile_coords(start, pos0, kv_hi, first, bt_row, BLOCK_SIZE: tl.constexpr):
    """The keys of the step at `start`: (ok, block, slot), each [WARPS, TILE_N]. (A block id per key: one scalar
    id per step where the step lies in one block, or two, cut the loop's instructions by 8% and measured 1.00-1.05x
    slower for TurboQuant, up to 1.1x for q8 on an H200, BENCHMARKS.md 2026-12-02.)"""
    offs_n = start + pos0
    ok = (offs_n < kv_hi) & (offs_n >= first)
    block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    return ok, block, offs_n % BLOCK_SIZE


@triton.jit
def load_groups(ptr, row, ok, W: tl.constexpr):
    """The four W-byte channel groups of the rows at ptr + row [WARPS, TILE_N]: one load of the rows, cut into
    groups in registers. Loaded a group at a time, each load is followed by its layout conversion through shared
    memory, which waits for it: four memory round trips in a row instead of one (TurboQuant q8_0 keys 1.10-1.15x
    slower on an H200)."""
    c02, c13 = tl.split(tl.reshape(tl.permute(tl.reshape(load_rows(ptr, row, tl.arange(0, 4 * W), ok),
                                                         [ok.shape[0], ok.shape[1], 2, 2, W]), (0, 1, 4, 2, 3)),
                                   [ok.shape[0], ok.shape[1], W, 2, 2]))
    c0, c2 = tl.split(c02)
    c1, c3 = tl.split(c13)
    return c0, c1, c2, c3


@triton.jit
def load_f16x4(ptr, row, ok):
    """The four float16 at ptr + row [WARPS, TILE_N] (8-byte aligned rows) in one 8-byte load per row."""
    x = tl.load((ptr + row).to(tl.pointer_type(tl.int64)), mask=ok, other=0)
    return half_of(x, 0), half_of(x, 16), half_of(x >> 32, 0), half_of(x >> 32, 16)


@triton.jit
def half_of(word, SHIFT: tl.constexpr):
    """The float16 in bits SHIFT..SHIFT+15 of an integer."""
    return ((word.to(tl.int32) >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def tq_key_tile(k_ptr, ks_ptr, kz_ptr, block, slot, ok, k_strides, ks_strides, K_BITS: tl.constexpr):
    """One step of TurboQuant keys as loaded, nothing converted: the codes of the four channel groups (q8_0: 32
    int8 per group; q4_0: 16 bytes per group, channels 2j and 2j + 1 in byte j), their scales, their zero points."""
    k_row = block * k_strides[0] + slot * k_strides[1]
    s_row = block * ks_strides[0] + slot * ks_strides[1]
    if K_BITS == 8:
        c0, c1, c2, c3 = load_groups(k_ptr, k_row, ok, 32)
    else:   # (one load for q4_0 keys, or for 4-bit values, measured 1.01-1.08x slower: byte permutes in registers)
        offs = tl.arange(0, 16)
        c0 = load_rows(k_ptr, k_row, offs, ok)
        c1 = load_rows(k_ptr + 16, k_row, offs, ok)
        c2 = load_rows(k_ptr + 32, k_row, offs, ok)
        c3 = load_rows(k_ptr + 48, k_row, offs, ok)
    s0, s1, s2, s3 = load_f16x4(ks_ptr, s_row, ok)
    z0, z1, z2, z3 = load_f16x4(kz_ptr, s_row, ok)
    return (c0, c1, c2, c3, s0, s1, s2, s3, z0, z1, z2, z3)


@triton.jit
def tq3_value_tile(v_ptr, vs_ptr, block, slot, ok, v_strides, vs_strides, offs_u, HEAD_DIM: tl.constexpr):
    """One step of TurboQuant 3-bit values as loaded: the units' M words and N bytes (`packing.pack_code_nibbles`),
    the four group scales."""
    v_row = block * v_strides[0] + slot * v_strides[1]
    vs_row = block * vs_strides[0] + slot * vs_strides[1]
    s0, s1, s2, s3 = load_f16x4(vs_ptr, vs_row, ok)
    return (load_rows(v_ptr.to(tl.pointer_type(tl.int16)), v_row // 2, offs_u, ok),
            load_rows(v_ptr + HEAD_DIM // 4, v_row, offs_u, ok), s0, s1, s2, s3)


@triton.jit
def tq4_value_tile(v_ptr, vs_ptr, block, slot, ok, v_strides, vs_strides, offs_u):
    """One step of TurboQuant 4-bit values as loaded: byte b of every unit (fields 2b, 2b + 1: group b, as sign
    nibbles, `packing.pack_sign_nibbles`), b = 0..3, then the four group scales."""
    v_row = block * v_strides[0] + slot * v_strides[1]
    vs_row = block * vs_strides[0] + slot * vs_strides[1]
    s0, s1, s2, s3 = load_f16x4(vs_ptr, vs_row, ok)
    return (load_rows(v_ptr, v_row, 4 * offs_u, ok), load_rows(v_ptr + 1, v_row, 4 * offs_u, ok),
            load_rows(v_ptr + 2, v_row, 4 * offs_u, ok), load_rows(v_ptr + 3, v_row, 4 * offs_u, ok),
            s0, s1, s2, s3)


@triton.jit
def group_scores_t(d, sc, z, qsum):
    """A channel group's scores^T from d = codes . q [WARPS, TILE_N, HR]: its scale and zero point go on score
    rows (scale * (d + zero * sum(q)))."""
    sc = sc.to(tl.float32)
    zs = z.to(tl.float32) * sc
    return d * sc[:, :, None] + zs[:, :, None] * qsum[:, None, :]


@triton.jit
def tq8_group_scores_t(codes, sc, z, qg, qsum, CDTYPE: tl.constexpr, FAST_CVT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """Scores^T [WARPS, TILE_N, HR] of one channel group of TurboQuant int8 keys, from loaded codes, scales, zeros."""
    d = tl.dot(int8_to_f16(codes, FAST_CVT).to(CDTYPE), qg, input_precision=DOT_PRECISION)
    return group_scores_t(d, sc, z, qsum)


@triton.jit
def tq4_group_scores_t(pairs, sc, z, qe, qo, qsum, CDTYPE: tl.constexpr, FAST_CVT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """The same for 4-bit keys: the group's even channels (low nibbles) against the query's even channels qe,
    the odd ones against qo (two products, no code moved to its channel)."""
    even, odd = nibble_pairs_to_f16(pairs, FAST_CVT)
    d = tl.dot(even.to(CDTYPE), qe, input_precision=DOT_PRECISION)
    d = tl.dot(odd.to(CDTYPE), qo, d, input_precision=DOT_PRECISION)
    return group_scores_t(d, sc, z, qsum)


@triton.jit
def quant_tile(k_ptr, ks_ptr, v_ptr, vs_ptr, block, slot, ok, k_strides, v_strides, ks_strides, vs_strides,
               offs_u, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One step of q4 / q6 pages as loaded: key and value scales in one load (`scale_pair`), key units (q6: and
    their 2-bit plane bytes), value units (and plane bytes). A load per scale tensor cost a memory round trip
    more per step (sm_90 SASS: each converted through shared memory before the next load goes out) and measured
    1.03-1.05x slower for q4, 1.00-1.02x for q6 on an H200 (BENCHMARKS.md, 2026-12-02)."""
    k_row = block * k_strides[0] + slot * k_strides[1]
    v_row = block * v_strides[0] + slot * v_strides[1]
    ks, vs = scale_pair(ks_ptr, vs_ptr, block, slot, ok, ks_strides, vs_strides)
    ku = load_rows(k_ptr.to(tl.pointer_type(tl.int16)), k_row // 2, offs_u, ok)
    vu = load_rows(v_ptr.to(tl.pointer_type(tl.int16)), v_row // 2, offs_u, ok)
    if BITS == 6:
        kh = load_rows(k_ptr + HEAD_DIM // 2, k_row, offs_u, ok)
        vh = load_rows(v_ptr + HEAD_DIM // 2, v_row, offs_u, ok)
    else:   # (q4 has no second plane: unused)
        kh = ku
        vh = vu
    return ku, kh, ks, vu, vh, vs


@triton.jit
def scale_pair(ks_ptr, vs_ptr, block, slot, ok, ks_strides, vs_strides):
    """A step's key and value scales in one load: a [.., 2] tensor of pointers into both scale pages."""
    ks_at = (ks_ptr + block * ks_strides[0] + slot * ks_strides[1])[:, :, None]
    vs_at = (vs_ptr + block * vs_strides[0] + slot * vs_strides[1])[:, :, None]
    pair = tl.load(tl.where(tl.arange(0, 2)[None, None, :] == 0, ks_at, vs_at), mask=ok[:, :, None], other=0.0)
    return tl.split(pair)


@triton.jit
def unit_quads(units, planes, BITS: tl.constexpr, FAST_CVT: tl.constexpr):
    if BITS == 6:
        return six_bit_quads_to_f16(units, planes, FAST_CVT)
    return nibble_quads_to_f16(units, FAST_CVT)


@triton.jit
def merge_t(acc, f, inv):
    """acc [WARPS, C, HR] with weights f [WARPS, HR] -> [C, HR] scaled by inv [HR]."""
    return tl.sum(acc * f[:, None, :], axis=0) * inv[None, :]


@triton.jit
def store_t(o_row_t, cols, acc, f, inv, mask):
    tl.store(o_row_t + cols[:, None], merge_t(acc, f, inv).to(o_row_t.dtype.element_ty), mask=mask)


@triton.jit
def rotate_t(out_t, rotation_ptr, chans, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out_t [C, HR] (channels `chans` [C]) -> its share of out @ rotation, [HR, HEAD_DIM]."""
    offs_d = tl.arange(0, HEAD_DIM)
    r = tl.load(rotation_ptr + chans[:, None] * HEAD_DIM + offs_d[None, :])
    return tl.dot(tl.trans(out_t), r, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_splits"])
def decode_kernel_transposed(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, q_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr, rotation_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, token_order_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    k_strides, v_strides, ks_strides, vs_strides,
    rq_ptr, rk_ptr, rv_ptr, ring_rows_ptr, ring_first_ptr, stride_rqt, stride_rqh, r_strides,   # RING: `attend_ring`
    num_seqs, num_splits, qk_scale, softcap, sliding_window,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    WARPS: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, KIND: tl.constexpr, K_BITS: tl.constexpr,
    FAST_CVT: tl.constexpr, DOT_PRECISION: tl.constexpr, RING: tl.constexpr, NUM_RING_BLOCKS: tl.constexpr,
    V_BITS: tl.constexpr = 3, ORDERED: tl.constexpr = False,
):
    token, kv_head, split = program_coords(token_order_ptr, ORDERED)
    seq = token_sequence(token, query_start_loc_ptr, num_seqs)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_pos = tl.load(seq_lens_ptr + seq) - q_len + (token - q_start)

    offs_h = tl.arange(0, ROWS)                   # ROWS: the group's heads, padded (the N dimension)
    h_ok = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    q_row_t = q_ptr + token.to(tl.int64) * stride_qt + head[None, :] * stride_qh      # [1, ROWS]
    QUANT: tl.constexpr = KIND == KVQUANT
    TQ: tl.constexpr = KIND == TURBOQUANT
    NV: tl.constexpr = (2 if K_BITS == 8 else 4) if QUANT else 1
    KU: tl.constexpr = QUANT and K_BITS != 8
    CDTYPE: tl.constexpr = tl.float32 if q_ptr.dtype.element_ty == tl.float32 else (
        tl.float16 if QUANT or TQ else q_ptr.dtype.element_ty)
    offs_c = tl.arange(0, HEAD_DIM_PAD)
    q_a = tl.load(q_row_t + offs_c[:, None], mask=h_ok[None, :] & (offs_c < HEAD_DIM)[:, None], other=0.0)
    q_a = tl.broadcast_to(q_a.to(CDTYPE)[None, :, :], [WARPS, HEAD_DIM_PAD, ROWS])
    VC: tl.constexpr = HEAD_DIM // 8 if TQ else (HEAD_DIM // NV if QUANT else 16)
    offs_u = tl.arange(0, VC)
    if KU:
        q0 = query_t(q_row_t, h_ok, 4 * offs_u, WARPS, CDTYPE)
        q1 = query_t(q_row_t, h_ok, 4 * offs_u + 1, WARPS, CDTYPE)
        q2 = query_t(q_row_t, h_ok, 4 * offs_u + 2, WARPS, CDTYPE)
        q3 = query_t(q_row_t, h_ok, 4 * offs_u + 3, WARPS, CDTYPE)
    if TQ and K_BITS == 8:   # the query's channel groups of 32 and their sums (the keys' zero points apply to them)
        offs32 = tl.arange(0, 32)
        qg0 = query_t(q_row_t, h_ok, offs32, WARPS, CDTYPE)
        qg1 = query_t(q_row_t, h_ok, 32 + offs32, WARPS, CDTYPE)
        qg2 = query_t(q_row_t, h_ok, 64 + offs32, WARPS, CDTYPE)
        qg3 = query_t(q_row_t, h_ok, 96 + offs32, WARPS, CDTYPE)
        qs0 = tl.sum(qg0.to(tl.float32), axis=1)
        qs1 = tl.sum(qg1.to(tl.float32), axis=1)
        qs2 = tl.sum(qg2.to(tl.float32), axis=1)
        qs3 = tl.sum(qg3.to(tl.float32), axis=1)
    elif TQ:                 # 4-bit keys: each group's even and odd channels, and the group's sums
        even = 2 * tl.arange(0, 16)
        qe0 = query_t(q_row_t, h_ok, even, WARPS, CDTYPE)
        qo0 = query_t(q_row_t, h_ok, even + 1, WARPS, CDTYPE)
        qe1 = query_t(q_row_t, h_ok, 32 + even, WARPS, CDTYPE)
        qo1 = query_t(q_row_t, h_ok, 33 + even, WARPS, CDTYPE)
        qe2 = query_t(q_row_t, h_ok, 64 + even, WARPS, CDTYPE)
        qo2 = query_t(q_row_t, h_ok, 65 + even, WARPS, CDTYPE)
        qe3 = query_t(q_row_t, h_ok, 96 + even, WARPS, CDTYPE)
        qo3 = query_t(q_row_t, h_ok, 97 + even, WARPS, CDTYPE)
        qs0 = tl.sum(qe0.to(tl.float32), axis=1) + tl.sum(qo0.to(tl.float32), axis=1)
        qs1 = tl.sum(qe1.to(tl.float32), axis=1) + tl.sum(qo1.to(tl.float32), axis=1)
        qs2 = tl.sum(qe2.to(tl.float32), axis=1) + tl.sum(qo2.to(tl.float32), axis=1)
        qs3 = tl.sum(qe3.to(tl.float32), axis=1) + tl.sum(qo3.to(tl.float32), axis=1)
    if TQ:
        V_ASM: tl.constexpr = FAST_CVT and CDTYPE == tl.float16

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
    kz_ptr += head_off * ks_strides[2]
    vs_ptr += head_off * vs_strides[2]
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    pos0 = tl.arange(0, WARPS)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]

    acc_a = tl.zeros([WARPS, HEAD_DIM_PAD, ROWS], dtype=tl.float32)
    acc0 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc1 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc2 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc3 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc4 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc5 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc6 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    acc7 = tl.zeros([WARPS, VC, ROWS], dtype=tl.float32)
    m_i = tl.full([WARPS, ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([WARPS, ROWS], dtype=tl.float32)
    body_hi = kv_hi
    if RING:   # the keys the dense recent window holds first, then their output in the accumulators' channels
        ring_from = tl.load(ring_first_ptr + seq) * BLOCK_SIZE
        if tl.maximum(first, ring_from) < kv_hi:   # only the splits that reach into the window (TurboQuant's
            acc_r, m_i, l_i, _ = attend_ring(      # rotation of the ring's output costs as much as 50 keys)
                seq, token, kv_head, head, h_ok, first, kv_hi, m_i, l_i, rq_ptr, rk_ptr, rv_ptr, ring_rows_ptr,
                ring_first_ptr, stride_rqt, stride_rqh, r_strides, qk_scale, softcap,
                HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, NUM_RING_BLOCKS, USE_SOFTCAP, DOT_PRECISION)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_a = ring_accumulators(
                acc_r, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_a, offs_u, rotation_ptr, TQ, NV, HEAD_DIM,
                DOT_PRECISION, WARPS, True)
        body_hi = tl.minimum(kv_hi, ring_from)
    for start in range(kv_lo, body_hi, STEP):   # the pages' keys
        ok, block, slot = tile_coords(start, pos0, body_hi, first, bt_row, BLOCK_SIZE)
        k_row = block * k_strides[0] + slot * k_strides[1]
        v_row = block * v_strides[0] + slot * v_strides[1]
        if TQ:
            kt = tq_key_tile(k_ptr, ks_ptr, kz_ptr, block, slot, ok, k_strides, ks_strides, K_BITS)
            if V_BITS == 3:
                vt = tq3_value_tile(v_ptr, vs_ptr, block, slot, ok, v_strides, vs_strides, offs_u, HEAD_DIM)
            else:
                vt = tq4_value_tile(v_ptr, vs_ptr, block, slot, ok, v_strides, vs_strides, offs_u)
        elif KU:
            t = quant_tile(k_ptr, ks_ptr, v_ptr, vs_ptr, block, slot, ok,
                           k_strides, v_strides, ks_strides, vs_strides, offs_u, K_BITS, HEAD_DIM)
        if TQ and K_BITS == 8:   # kt: key codes per group 0-3, scales 4-7, zero points 8-11
            s = tq8_group_scores_t(kt[0], kt[4], kt[8], qg0, qs0, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq8_group_scores_t(kt[1], kt[5], kt[9], qg1, qs1, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq8_group_scores_t(kt[2], kt[6], kt[10], qg2, qs2, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq8_group_scores_t(kt[3], kt[7], kt[11], qg3, qs3, CDTYPE, FAST_CVT, DOT_PRECISION)
        elif TQ:
            s = tq4_group_scores_t(kt[0], kt[4], kt[8], qe0, qo0, qs0, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq4_group_scores_t(kt[1], kt[5], kt[9], qe1, qo1, qs1, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq4_group_scores_t(kt[2], kt[6], kt[10], qe2, qo2, qs2, CDTYPE, FAST_CVT, DOT_PRECISION)
            s += tq4_group_scores_t(kt[3], kt[7], kt[11], qe3, qo3, qs3, CDTYPE, FAST_CVT, DOT_PRECISION)
        elif KU:  # t: key units, their plane bytes, key scales, value units, plane bytes, value scales
            k0, k1, k2, k3 = unit_quads(t[0], t[1], K_BITS, FAST_CVT)
            s = tl.dot(k0.to(CDTYPE), q0, input_precision=DOT_PRECISION)
            s = tl.dot(k1.to(CDTYPE), q1, s, input_precision=DOT_PRECISION)
            s = tl.dot(k2.to(CDTYPE), q2, s, input_precision=DOT_PRECISION)
            s = tl.dot(k3.to(CDTYPE), q3, s, input_precision=DOT_PRECISION)
            s = s * t[2][:, :, None]
        elif QUANT:
            k = int8_to_f16(load_rows(k_ptr, k_row, offs_c, ok), FAST_CVT).to(CDTYPE)
            s = tl.dot(k, q_a, input_precision=DOT_PRECISION)
            s = s * tl.load(ks_ptr + block * ks_strides[0] + slot * ks_strides[1], mask=ok, other=0.0)[:, :, None]
        else:
            k = tl.load(k_ptr + k_row[:, :, None] + offs_c[None, None, :],
                        mask=ok[:, :, None] & (offs_c < HEAD_DIM)[None, None, :], other=0.0)
            s = tl.dot(k.to(CDTYPE), q_a, input_precision=DOT_PRECISION)   # [WARPS, TILE_N, ROWS]
        p, alpha, m_new, l_i = softmax_step_t(s, ok, m_i, l_i, qk_scale, softcap, USE_SOFTCAP)
        if KU:
            p = p * t[5][:, :, None]
        elif QUANT:
            p = p * tl.load(vs_ptr + block * vs_strides[0] + slot * vs_strides[1], mask=ok, other=0.0)[:, :, None]
        p_f = p
        p = p.to(CDTYPE)
        a3 = alpha[:, None, :]
        if TQ:   # each group's scale goes on P's columns; accumulator J holds channels value_channels(J)
            if V_BITS == 3:   # vt: M words, N bytes, scales 2-5
                v0, v1, v2, v3, v4, v5, v6, v7 = code_nibbles_to_f16(vt[0], vt[1], codebook_ptr, V_ASM)
                p0 = (p_f * vt[2].to(tl.float32)[:, :, None]).to(CDTYPE)
                p1 = (p_f * vt[3].to(tl.float32)[:, :, None]).to(CDTYPE)
                p2 = (p_f * vt[4].to(tl.float32)[:, :, None]).to(CDTYPE)
                p3 = (p_f * vt[5].to(tl.float32)[:, :, None]).to(CDTYPE)
            else:             # vt: the units' bytes 0-3 (fields 0, 1 .. 6, 7), scales 4-7
                v0, v1 = sign_nibble_pairs_to_f16(vt[0], codebook_ptr, V_ASM)
                v2, v3 = sign_nibble_pairs_to_f16(vt[1], codebook_ptr, V_ASM)
                v4, v5 = sign_nibble_pairs_to_f16(vt[2], codebook_ptr, V_ASM)
                v6, v7 = sign_nibble_pairs_to_f16(vt[3], codebook_ptr, V_ASM)
                p0 = (p_f * vt[4].to(tl.float32)[:, :, None]).to(CDTYPE)
                p1 = (p_f * vt[5].to(tl.float32)[:, :, None]).to(CDTYPE)
                p2 = (p_f * vt[6].to(tl.float32)[:, :, None]).to(CDTYPE)
                p3 = (p_f * vt[7].to(tl.float32)[:, :, None]).to(CDTYPE)
            acc0 = tl.dot(tl.trans(v0.to(CDTYPE), (0, 2, 1)), p0, acc0 * a3, input_precision=DOT_PRECISION)
            acc1 = tl.dot(tl.trans(v1.to(CDTYPE), (0, 2, 1)), p0, acc1 * a3, input_precision=DOT_PRECISION)
            acc2 = tl.dot(tl.trans(v2.to(CDTYPE), (0, 2, 1)), p1, acc2 * a3, input_precision=DOT_PRECISION)
            acc3 = tl.dot(tl.trans(v3.to(CDTYPE), (0, 2, 1)), p1, acc3 * a3, input_precision=DOT_PRECISION)
            acc4 = tl.dot(tl.trans(v4.to(CDTYPE), (0, 2, 1)), p2, acc4 * a3, input_precision=DOT_PRECISION)
            acc5 = tl.dot(tl.trans(v5.to(CDTYPE), (0, 2, 1)), p2, acc5 * a3, input_precision=DOT_PRECISION)
            acc6 = tl.dot(tl.trans(v6.to(CDTYPE), (0, 2, 1)), p3, acc6 * a3, input_precision=DOT_PRECISION)
            acc7 = tl.dot(tl.trans(v7.to(CDTYPE), (0, 2, 1)), p3, acc7 * a3, input_precision=DOT_PRECISION)
        elif KU:
            v0, v1, v2, v3 = unit_quads(t[3], t[4], K_BITS, FAST_CVT)
            acc0 = tl.dot(tl.trans(v0.to(CDTYPE), (0, 2, 1)), p, acc0 * a3, input_precision=DOT_PRECISION)
            acc1 = tl.dot(tl.trans(v1.to(CDTYPE), (0, 2, 1)), p, acc1 * a3, input_precision=DOT_PRECISION)
            acc2 = tl.dot(tl.trans(v2.to(CDTYPE), (0, 2, 1)), p, acc2 * a3, input_precision=DOT_PRECISION)
            acc3 = tl.dot(tl.trans(v3.to(CDTYPE), (0, 2, 1)), p, acc3 * a3, input_precision=DOT_PRECISION)
        elif QUANT:
            v0, v1 = int8_pairs_to_f16(load_rows(v_ptr.to(tl.pointer_type(tl.int16)), v_row // 2, offs_u, ok), FAST_CVT)
            acc0 = tl.dot(tl.trans(v0.to(CDTYPE), (0, 2, 1)), p, acc0 * a3, input_precision=DOT_PRECISION)
            acc1 = tl.dot(tl.trans(v1.to(CDTYPE), (0, 2, 1)), p, acc1 * a3, input_precision=DOT_PRECISION)
        else:
            v = tl.load(v_ptr + v_row[:, :, None] + offs_c[None, None, :],
                        mask=ok[:, :, None] & (offs_c < HEAD_DIM)[None, None, :], other=0.0)
            acc_a = tl.dot(tl.trans(v.to(CDTYPE), (0, 2, 1)), p, acc_a * a3, input_precision=DOT_PRECISION)
        m_i = m_new

    m = tl.max(m_i, axis=0)                                                   # [ROWS]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    f = tl.math.exp2(m_i - m_safe[None, :])                                   # [WARPS, ROWS]
    l = tl.sum(l_i * f, axis=0)
    if SPLIT:
        state = (token.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + state, m, mask=h_ok)
        tl.store(part_l_ptr + state, l, mask=h_ok)
        o_row_t = part_out_ptr + state[None, :] * HEAD_DIM_PAD
        inv = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        o_row_t = out_ptr + token.to(tl.int64) * stride_ot + head[None, :] * stride_oh
        inv = 1.0 / tl.where(l > 0, l, 1.0)
    cols_ok = h_ok[None, :]
    if TQ and not SPLIT:
        out = rotate_t(merge_t(acc0, f, inv), rotation_ptr, value_channels(0, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc1, f, inv), rotation_ptr, value_channels(1, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc2, f, inv), rotation_ptr, value_channels(2, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc3, f, inv), rotation_ptr, value_channels(3, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc4, f, inv), rotation_ptr, value_channels(4, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc5, f, inv), rotation_ptr, value_channels(5, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc6, f, inv), rotation_ptr, value_channels(6, offs_u), HEAD_DIM, DOT_PRECISION)
        out += rotate_t(merge_t(acc7, f, inv), rotation_ptr, value_channels(7, offs_u), HEAD_DIM, DOT_PRECISION)
        offs_d = tl.arange(0, HEAD_DIM)
        o_row = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh
        tl.store(o_row + offs_d[None, :], out.to(o_row.dtype.element_ty), mask=h_ok[:, None])
    elif TQ:
        store_t(o_row_t, value_channels(0, offs_u), acc0, f, inv, cols_ok)
        store_t(o_row_t, value_channels(1, offs_u), acc1, f, inv, cols_ok)
        store_t(o_row_t, value_channels(2, offs_u), acc2, f, inv, cols_ok)
        store_t(o_row_t, value_channels(3, offs_u), acc3, f, inv, cols_ok)
        store_t(o_row_t, value_channels(4, offs_u), acc4, f, inv, cols_ok)
        store_t(o_row_t, value_channels(5, offs_u), acc5, f, inv, cols_ok)
        store_t(o_row_t, value_channels(6, offs_u), acc6, f, inv, cols_ok)
        store_t(o_row_t, value_channels(7, offs_u), acc7, f, inv, cols_ok)
    elif QUANT:
        store_t(o_row_t, NV * offs_u, acc0, f, inv, cols_ok)
        store_t(o_row_t, NV * offs_u + 1, acc1, f, inv, cols_ok)
        if NV == 4:
            store_t(o_row_t, NV * offs_u + 2, acc2, f, inv, cols_ok)
            store_t(o_row_t, NV * offs_u + 3, acc3, f, inv, cols_ok)
    else:
        store_t(o_row_t, offs_c, acc_a, f, inv, cols_ok & (offs_c < HEAD_DIM)[:, None])
