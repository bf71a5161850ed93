"""Device functions shared by the attention kernels: finding a program's sequence, and the online-softmax
loop over a range of key tiles read straight from pages.

Rows of a query tile are (query token, query head of one KV head's group) pairs: row r holds token
`r // GROUP` of the tile and head `kv_head * GROUP + r % GROUP`, so one pass over the keys serves the
whole group and `tl.dot` gets tiles of at least 16 rows.
"""

import triton
import triton.language as tl

from .codecs import KVQUANT, compute_dtype, load_keys, load_token_scales, load_values

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def find_sequence(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block `q_block` (sequence i starts at block qsl[i] // BLOCK_Q + i)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def rotate_rows(x, rotation_ptr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x [R, HEAD_DIM] float32 @ rotation [HEAD_DIM, HEAD_DIM] (row-major float32)."""
    offs = tl.arange(0, HEAD_DIM)
    rotation = tl.load(rotation_ptr + offs[:, None] * HEAD_DIM + offs[None, :])
    return tl.dot(x, rotation, input_precision=DOT_PRECISION)


@triton.jit
def load_queries(q_ptr, q_rows, head, row_ok, stride_qt, stride_qh, q_rotation_ptr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROTATE_Q: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 KIND: tl.constexpr):
    """Query rows [BLOCK_M, HEAD_DIM_PAD], in the keys' domain (rotated when the format rotates keys) and in
    the dtype the format's keys are rebuilt in (`codecs.compute_dtype`)."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if ROTATE_Q:
        q = rotate_rows(q.to(tl.float32), q_rotation_ptr, HEAD_DIM, DOT_PRECISION)
    return q.to(compute_dtype(KIND, q_ptr.dtype.element_ty))


@triton.jit
def attend_tiles(
    q, acc, m_i, l_i,                 # q: [BLOCK_M, HEAD_DIM_PAD]; acc fp32 [BLOCK_M, HEAD_DIM_PAD]; m_i, l_i fp32 [BLOCK_M]
    q_pos,                            # [BLOCK_M] int32 absolute position of each row's query token
    kv_lo, kv_hi,                     # keys [kv_lo, kv_hi) of this sequence are visited (kv_lo a multiple of TILE_N)
    block_table_row_ptr,              # this sequence's row of the block table
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr,
    k_strides, v_strides, ks_strides, vs_strides,   # (block, slot) strides; the KV head offset is already in the pointers
    qk_scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, MASKED: tl.constexpr,
    KIND: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over keys [kv_lo, kv_hi): returns the updated (acc, m_i, l_i), scores in log2 units.

    MASKED=False is for ranges every row sees whole (kv_hi a multiple of TILE_N): no causal, window or
    bounds checks."""
    offs_t = tl.arange(0, TILE_N)
    for tile_start in range(kv_lo, kv_hi, TILE_N):
        offs_n = tile_start + offs_t
        if MASKED:
            in_range = offs_n < kv_hi
        else:
            in_range = offs_t < TILE_N
        block = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k = load_keys(k_ptr, ks_ptr, kz_ptr, block, slot, in_range, k_strides, ks_strides,
                      HEAD_DIM, HEAD_DIM_PAD, KIND, K_BITS, q.dtype)            # [TILE_N, HEAD_DIM_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)             # [BLOCK_M, TILE_N]
        if KIND == KVQUANT:
            s = s * load_token_scales(ks_ptr, block, slot, in_range, ks_strides)[None, :]
        if USE_SOFTCAP:
            s = softcap * tanh(s * (qk_scale / softcap)) * LOG2E
        else:
            s = s * (qk_scale * LOG2E)
        if MASKED:
            visible = in_range[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_values(v_ptr, vs_ptr, codebook_ptr, block, slot, in_range, v_strides, vs_strides,
                        HEAD_DIM, HEAD_DIM_PAD, KIND, V_BITS, q.dtype)          # [TILE_N, HEAD_DIM_PAD]
        if KIND == KVQUANT:
            p = p * load_token_scales(vs_ptr, block, slot, in_range, vs_strides)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attend_range(
    q, acc, m_i, l_i, q_pos, kv_lo, kv_hi, min_pos, max_pos, block_table_row_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr, k_strides, v_strides, ks_strides, vs_strides,
    qk_scale, softcap, sliding_window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    KIND: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Keys [kv_lo, kv_hi) for query rows at positions [min_pos, max_pos]: whole tiles that every row
    sees (keys <= min_pos, and > max_pos - window) run without masks; the tiles at the window's start and
    at the causal diagonal run masked."""
    full_hi = tl.minimum((min_pos + 1) // TILE_N * TILE_N, kv_hi)
    full_lo = kv_lo
    if USE_WINDOW:
        full_lo = tl.maximum(tl.cdiv(max_pos - sliding_window + 1, TILE_N) * TILE_N, kv_lo)
    full_lo = tl.minimum(full_lo, kv_hi)
    full_hi = tl.maximum(full_hi, full_lo)
    acc, m_i, l_i = attend_tiles(
        q, acc, m_i, l_i, q_pos, kv_lo, full_lo, block_table_row_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr,
        codebook_ptr, k_strides, v_strides, ks_strides, vs_strides, qk_scale, softcap, sliding_window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, True, KIND, K_BITS, V_BITS, DOT_PRECISION)
    acc, m_i, l_i = attend_tiles(
        q, acc, m_i, l_i, q_pos, full_lo, full_hi, block_table_row_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr,
        codebook_ptr, k_strides, v_strides, ks_strides, vs_strides, qk_scale, softcap, sliding_window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, False, KIND, K_BITS, V_BITS, DOT_PRECISION)
    acc, m_i, l_i = attend_tiles(
        q, acc, m_i, l_i, q_pos, full_hi, kv_hi, block_table_row_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr,
        codebook_ptr, k_strides, v_strides, ks_strides, vs_strides, qk_scale, softcap, sliding_window,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, USE_SOFTCAP, USE_WINDOW, True, KIND, K_BITS, V_BITS, DOT_PRECISION)
    return acc, m_i, l_i
