"""Loads shared by the two decode kernels (`decode.py`, `decode_transposed.py`): page rows, q4/q6 codes in
units of four channels, the sequence a packed query token belongs to, and the keys of a sequence's dense
recent window (its ring: `attend_ring`); and the launch order every decode kernel shares, the Gluon ones too
(`launch_grid`, `program_coords`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conversions import nibble_quads_to_f16, six_bit_quads_to_f16
from .tiles import LOG2E, tanh


MAX_GRID_Z = 65535   # CUDA's limit on a grid's third dimension: more tokens launch in grid order


def launch_grid(query: torch.Tensor, meta, heads: int, num_splits: int, ordered: bool | None):
    """(grid, token order, ORDERED) of a decode kernel's launch over `heads` KV heads (or head groups) a token.
    ordered None: in `meta.token_order`'s order when the planner gave one (`metadata.LONGEST_FIRST`), True: in that
    order or, without one, longest first from the batch's host lengths (benchmarks), False: grid order."""
    num_tokens = query.shape[0]
    if ordered is not False and num_tokens <= MAX_GRID_Z:
        order = meta.token_order
        if order is None and ordered:
            order = longest_first_on_device(meta, num_tokens)
        if order is not None:
            return (heads, num_splits, num_tokens), order, True
    return (num_tokens, heads, num_splits), meta.seq_lens, False


def longest_first_on_device(meta, num_tokens: int) -> torch.Tensor:
    """`metadata.longest_first` of a batch of equally many query tokens per sequence, from its host lengths, on the
    metadata's device (benchmarks: planners give `meta.token_order` themselves)."""
    from ..metadata import longest_first

    num_seqs = meta.num_seqs
    per = num_tokens // max(num_seqs, 1)
    if meta.query_start_loc_cpu != [i * per for i in range(num_seqs + 1)] or per * num_seqs != num_tokens:
        raise ValueError("a longest-first launch order is computed here only for batches of equally many query "
                         "tokens per sequence; give the metadata a token_order")
    return torch.from_numpy(longest_first(meta.seq_lens_cpu, per)).to(meta.seq_lens.device)


@triton.jit
def program_coords(token_order_ptr, ORDERED: tl.constexpr):
    """(query token, KV head or head group, split) of this program: grid (tokens, heads, splits), or with ORDERED
    (heads, splits, tokens) over the tokens in `token_order_ptr`'s order (`launch_grid`), so the programs of one
    token are launched together and the longest tokens first, a key range's heads side by side (a block's heads
    are adjacent in head-major pages: one sequence of 32,768 tokens decoded 2% slower with splits side by side).
    The Gluon kernels call it too (scalar work only)."""
    if ORDERED:
        token = tl.load(token_order_ptr + tl.program_id(2)).to(tl.int32)
        head = tl.program_id(0)
        split = tl.program_id(1)
    else:
        token = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
    return token, head, split


@triton.jit
def load_rows(ptr, row, offs, mask):
    """[WARPS, TILE_N, len(offs)] elements at ptr + row [WARPS, TILE_N] + offs."""
    return tl.load(ptr + row[:, :, None] + offs[None, None, :], mask=mask[:, :, None], other=0)


@triton.jit
def load_quads(ptr, row, offs_u, ok, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, FAST_CVT: tl.constexpr):
    """q4 / q6 codes of the rows at ptr + row [WARPS, TILE_N] in units of four channels: four float16
    tensors [WARPS, TILE_N, HEAD_DIM // 4], channel 4u + i in the i-th. A unit is one int16 of the nibble
    plane (plus, for q6, one byte of the 2-bit plane), so the matrix units read values as 16-bit pairs."""
    units = load_rows(ptr.to(tl.pointer_type(tl.int16)), row // 2, offs_u, ok)
    if BITS == 6:
        return six_bit_quads_to_f16(units, load_rows(ptr + HEAD_DIM // 2, row, offs_u, ok), FAST_CVT)
    return nibble_quads_to_f16(units, FAST_CVT)


@triton.jit
def token_sequence(token, query_start_loc_ptr, num_seqs):
    """The sequence whose query rows hold packed query token `token`: the last i with qsl[i] <= token. A decode
    batch's (token t is sequence t's one query) in one round of independent loads, others by halving (a load
    each, in a row)."""
    lo = 0
    hi = num_seqs
    guess = tl.minimum(token, num_seqs - 1)
    if (tl.load(query_start_loc_ptr + guess) <= token) & (tl.load(query_start_loc_ptr + guess + 1) > token):
        lo = guess + 1
        hi = guess + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def softmax_step_t(s, ok, m_i, l_i, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """One online-softmax step over raw scores^T s [WARPS, TILE_N, ROWS] of the keys `ok` [WARPS, TILE_N]:
    returns (p, alpha, m_i, l_i), scores in log2 units (p [WARPS, TILE_N, ROWS], the rest [WARPS, ROWS])."""
    if USE_SOFTCAP:
        s = softcap * tanh(s * (qk_scale / softcap)) * LOG2E
    else:
        s = s * (qk_scale * LOG2E)
    s = tl.where(ok[:, :, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None, :])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def attend_ring(seq, token, kv_head, head, h_ok, first, kv_hi, m_i, l_i,
                rq_ptr, rk_ptr, rv_ptr, ring_rows_ptr, ring_first_ptr, stride_rqt, stride_rqh, r_strides,
                qk_scale, softcap, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                NUM_RING_BLOCKS: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                TILE_N: tl.constexpr = 16, STAGES: tl.constexpr = None):
    """The keys [first, kv_hi) of sequence `seq` that its dense recent window holds (`pagedkv.window`): from
    block ring_first_ptr[seq] on, logical block b in ring slot b % NUM_RING_BLOCKS of ring row ring_rows_ptr[seq].
    The rings rk_ptr / rv_ptr are read as pages [num_rows * NUM_RING_BLOCKS, BLOCK_SIZE, H, D] with (block,
    slot, head) strides r_strides. The queries (query heads `head` [ROWS] of packed token `token`) are the
    model's, rq_ptr (not rotated), and the products run in their dtype, as over dense pages. Continues the
    online softmax (m_i, l_i) [WARPS, ROWS], each warp on its own TILE_N keys per step (16: a dense tile of 128
    channels is 32 registers a thread, beside the pages' state), the loads of STAGES - 1 steps ahead in flight
    (None: as the kernel's num_stages pipelines its loops).

    Returns (acc, m_i, l_i, body_hi): the state merged over the warps, held by the first (the others start
    afresh): acc [HEAD_DIM_PAD, ROWS] float32 its unnormalised output^T in the model's domain (`on_first_warp`
    places it), m_i, l_i [WARPS, ROWS]; the keys [first, body_hi) before the window are the pages' to read."""
    WARPS: tl.constexpr = m_i.shape[0]
    ROWS: tl.constexpr = h_ok.shape[0]
    STEP: tl.constexpr = WARPS * TILE_N
    pos0 = tl.arange(0, WARPS)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
    RDTYPE: tl.constexpr = rq_ptr.dtype.element_ty
    ring_from = tl.load(ring_first_ptr + seq) * BLOCK_SIZE
    lo = tl.maximum(first, ring_from)
    r_head = kv_head.to(tl.int64) * r_strides[2]
    rk_ptr += r_head
    rv_ptr += r_head
    ring_block0 = tl.load(ring_rows_ptr + seq).to(tl.int64) * NUM_RING_BLOCKS
    offs_c = tl.arange(0, HEAD_DIM_PAD)
    c_ok = offs_c < HEAD_DIM
    rq_row_t = rq_ptr + token.to(tl.int64) * stride_rqt + head[None, :] * stride_rqh    # [1, ROWS]
    q = tl.load(rq_row_t + offs_c[:, None], mask=h_ok[None, :] & c_ok[:, None], other=0.0)
    q = tl.broadcast_to(q[None, :, :], [WARPS, HEAD_DIM_PAD, ROWS])
    acc = tl.zeros([WARPS, HEAD_DIM_PAD, ROWS], dtype=tl.float32)
    for start in tl.range(lo // STEP * STEP, kv_hi, STEP, num_stages=STAGES):
        offs_n = start + pos0
        ok = (offs_n < kv_hi) & (offs_n >= lo)
        block = ring_block0 + (offs_n // BLOCK_SIZE) % NUM_RING_BLOCKS
        row = block * r_strides[0] + (offs_n % BLOCK_SIZE) * r_strides[1]
        mask = ok[:, :, None] & c_ok[None, None, :]
        k = tl.load(rk_ptr + row[:, :, None] + offs_c[None, None, :], mask=mask, other=0.0).to(RDTYPE)
        s = tl.dot(k, q, input_precision=DOT_PRECISION)                      # [WARPS, TILE_N, ROWS]
        p, alpha, m_i, l_i = softmax_step_t(s, ok, m_i, l_i, qk_scale, softcap, USE_SOFTCAP)
        v = tl.load(rv_ptr + row[:, :, None] + offs_c[None, None, :], mask=mask, other=0.0).to(RDTYPE)
        acc = tl.dot(tl.trans(v, (0, 2, 1)), p.to(RDTYPE), acc * alpha[:, None, :], input_precision=DOT_PRECISION)
    m = tl.max(m_i, axis=0)                                                   # [ROWS]
    f = tl.math.exp2(m_i - tl.where(m == float("-inf"), 0.0, m)[None, :])     # [WARPS, ROWS]
    first_warp = (tl.arange(0, WARPS) == 0)[:, None]
    l_i = tl.where(first_warp, tl.sum(l_i * f, axis=0)[None, :], 0.0)
    m_i = tl.where(first_warp, m[None, :], float("-inf"))
    return tl.sum(acc * f[:, None, :], axis=0), m_i, l_i, tl.minimum(kv_hi, ring_from)


@triton.jit
def on_first_warp(x, WARPS: tl.constexpr):
    """x [A, B] as a warp's accumulator [WARPS, A, B]: the first warp's, zeros for the others."""
    first_warp = tl.arange(0, WARPS) == 0
    return tl.where(first_warp[:, None, None], x[None, :, :], 0.0)


@triton.jit
def ring_rotated(acc, chans, rotation_ptr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Channels `chans` [C] of the ring's output^T acc [HEAD_DIM, ROWS] (`attend_ring`) in the rotated domain
    TurboQuant accumulates values in (out = out_rot @ rotation, so out_rot = out @ rotation^T), per query row:
    [ROWS, C]. (Query rows on M: a product of few rows, which needs no shared memory for its operands.)"""
    offs_d = tl.arange(0, HEAD_DIM)
    r = tl.load(rotation_ptr + chans[None, :] * HEAD_DIM + offs_d[:, None])          # [HEAD_DIM, C]
    return tl.dot(tl.trans(acc), r, input_precision=DOT_PRECISION)


@triton.jit
def value_channels(J: tl.constexpr, offs_u):
    """The channels accumulator J of TurboQuant values holds (offs_u: arange(16), head_dim 128): field J of every
    unit (`packing.unit_order`, 3- and 4-bit values), channels 16 J + u."""
    return 16 * J + offs_u


@triton.jit
def on_first_warp_t(x, WARPS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """x [ROWS, C] as a warp's accumulator: [WARPS, C, ROWS] in the transposed kernel, else [WARPS, ROWS, C]."""
    if TRANSPOSED:
        x = tl.trans(x)
    return on_first_warp(x, WARPS)


@triton.jit
def ring_tq(acc, J: tl.constexpr, offs_u, rotation_ptr, HEAD_DIM: tl.constexpr,
            DOT_PRECISION: tl.constexpr, WARPS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The ring's output^T acc (`attend_ring`) as TurboQuant's accumulator J (channels `value_channels(J)`)."""
    chans = value_channels(J, offs_u)
    return on_first_warp_t(ring_rotated(acc, chans, rotation_ptr, HEAD_DIM, DOT_PRECISION), WARPS, TRANSPOSED)


@triton.jit
def ring_accumulators(acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_a, offs_u, rotation_ptr,
                      KIND_TQ: tl.constexpr, NV: tl.constexpr, HEAD_DIM: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, WARPS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The ring's output^T acc [HEAD_DIM, ROWS] (`attend_ring`) placed on the first warp of the accumulators
    the decode kernel's pages use: TurboQuant's eight (KIND_TQ), KV-Quant's units (NV 2 or 4: channel NV u + i
    in accumulator i), or the dense one (NV 1), in the kernel's orientation. The others come back unchanged."""
    if KIND_TQ:
        acc0 = ring_tq(acc, 0, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc1 = ring_tq(acc, 1, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc2 = ring_tq(acc, 2, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc3 = ring_tq(acc, 3, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc4 = ring_tq(acc, 4, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc5 = ring_tq(acc, 5, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc6 = ring_tq(acc, 6, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
        acc7 = ring_tq(acc, 7, offs_u, rotation_ptr, HEAD_DIM, DOT_PRECISION, WARPS, TRANSPOSED)
    elif NV > 1:
        out = tl.trans(acc)                                                           # [ROWS, HEAD_DIM]
        if NV == 2:
            c0, c1 = tl.split(tl.reshape(out, [out.shape[0], out.shape[1] // 2, 2]))
        else:
            even, odd = tl.split(tl.reshape(out, [out.shape[0], out.shape[1] // 4, 2, 2]))   # channel 4u + 2a + b: b
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
            acc2 = on_first_warp_t(c2, WARPS, TRANSPOSED)
            acc3 = on_first_warp_t(c3, WARPS, TRANSPOSED)
        acc0 = on_first_warp_t(c0, WARPS, TRANSPOSED)
        acc1 = on_first_warp_t(c1, WARPS, TRANSPOSED)
    else:
        acc_a = on_first_warp_t(tl.trans(acc), WARPS, TRANSPOSED)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_a
