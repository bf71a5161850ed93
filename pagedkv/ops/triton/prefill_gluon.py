"""Prefill over dense pages in Gluon for Hopper (sm_90): page blocks copied by TMA by a producer warp, two consumer
warp groups running both products on `wgmma` on their own, each overlapping the softmax of one key tile with the
tensor cores' work on the tile before (FlashAttention-3's layout).

The tile-language varlen kernel (`attention.py`) runs both products of a key tile and its softmax one after the
other, and the two warp groups of a program run in step: while the exponentials of a tile run, the tensor
cores wait. Here each loop step issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} asynchronously, waits for S_j
only, and computes P_j while the tensor cores still run P_{j-1} V_{j-1} (intra-warpgroup pipelining). Page blocks
arrive by TMA, one copy per block (a block's slots of one KV head are one contiguous run,
`formats.base.empty_pages`), into shared memory in the layout `wgmma` reads; no consumer register holds an
address. Two key and two value buffers: the producer warp (`ws_producer`) refills one as soon as both consumer
warp groups have handed it back (an arrive each on its "empty" barrier), so nothing makes the two warp groups wait
for each other, and one's exponentials run while the other's products do.

Rows of a program are (query token, query head of one KV head's group) pairs, as in `attention.py`: 128 rows (64 a
consumer warp group), 128 keys a step. Only the tiles that reach the causal diagonal are masked; the slots past a
sequence's end in its last value tile are zeroed in shared memory (NaN there times a zero weight would be NaN).
Measured on an H200 (`bench/prefill_probe.py`, 2026-12-03): a 2,048-token chunk 0.089 ms without context (0.92x
SDPA's speed) and 0.528 ms after 8K tokens (1.77x, 586 TFLOP/s); the same loop over 8 warps without a producer,
its copies issued between the steps by the program's first thread (Triton 3.6 puts a barrier across the program
before each, which also keeps the warp groups in step), 0.143 and 0.866 ms (commit 7522b7b has it).

Dense pages (and the dense scratch pages of `dense_prefill.py`), bfloat16 or float16 queries, head_dim 64 or 128,
no soft-capping or sliding window: `supports` says which batches it can run, `serves` which it runs; the others
run the tile-language kernel. Gluon has no interpreter: on the CPU it is compiled for sm_90
(`tests/triton/test_sm90_compile.py`); on the GPU checked against the reference (`tests/triton/test_prefill_gluon.py`).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..metadata import AttentionMetadata
from .page_view import page_view, stored_head_major

LOG2E = 1.4426950408889634   # the host scales scores into log2 units: qk_scale = scale * LOG2E
BLOCK_M = 128      # rows (query token x group head) a program
TILE_N = gl.constexpr(128)   # keys a loop step
STAGES = gl.constexpr(2)   # buffers of key tiles and of value tiles


@gluon.jit
def find_sequence(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q: gl.constexpr):
    """The sequence owning global query block `q_block` (sequence i starts at block qsl[i] // BLOCK_Q + i), as
    `tiles.find_sequence`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if gl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@gluon.jit
def copy_tile(desc, bar, buf, bt_row, tile, last_block, kv_head, NUM_KV_HEADS: gl.constexpr,
              BLOCK_SIZE: gl.constexpr):
    """TMA copies of key or value tile `tile` (TILE_N // BLOCK_SIZE page blocks) into `buf`, signalled on `bar`.
    Blocks past the sequence's last one copy that block again (their keys are masked, their values zeroed)."""
    mbarrier.expect(bar, desc.block_type.nbytes * (TILE_N // BLOCK_SIZE))
    for i in gl.static_range(TILE_N // BLOCK_SIZE):
        block = gl.load(bt_row + gl.minimum(tile * (TILE_N // BLOCK_SIZE) + i, last_block))
        tma.async_copy_global_to_shared(desc, [(block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE, 0], bar,
                                        buf.slice(i * BLOCK_SIZE, BLOCK_SIZE))


@gluon.jit
def softmax_tile(s, m_i, l_i, tile_start, q_pos, kv_hi, qk_scale, MASKED: gl.constexpr, S_LAYOUT: gl.constexpr):
    """Online softmax over scores s [BLOCK_M, TILE_N] (raw): (p, alpha, m_i, l_i), m_i in scaled log2 units.
    MASKED: keys past a row's position or the sequence's end get no weight."""
    if MASKED:
        keys = tile_start + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, S_LAYOUT))
        visible = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] < kv_hi)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def zero_tail_rows(buf, valid, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """Rows >= valid of the value tile `buf` set to zero: slots past the sequence's end may hold anything (a NaN
    times a zero weight is NaN)."""
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    v = buf.load(rows_layout)
    rows = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, rows_layout))
    buf.store(gl.where((rows < valid)[:, None], v, gl.zeros_like(v)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def ws_consumer(WG: gl.constexpr, out_ptr, q_ptr, q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty,
                q_start, q_len, first, context, kv_hi, num_tiles, num_full, kv_head,
                stride_qt, stride_qh, stride_ot, stride_oh, qk_scale,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr, ROWS: gl.constexpr,
                TILE_N: gl.constexpr):
    """One consumer warp group: rows [WG * ROWS, (WG + 1) * ROWS) of the program's block. Each loop step issues
    S_j and P_{j-1} V_{j-1}, waits for S_j alone and computes P_j while P_{j-1} V_{j-1} runs; a key or value buffer
    is handed back to the producer (an arrive on its "empty" barrier, which counts both warp groups) once this warp
    group is done with it."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    Q_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    rows = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_LOAD))
    token = first + rows // GROUP
    row_ok = (token < q_len) & (rows < BLOCK_Q * GROUP)
    q_offs = ((q_start + token).to(gl.int64) * stride_qt + (kv_head * GROUP + rows % GROUP) * stride_qh)[:, None] \
        + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_LOAD))[None, :]
    q_smem.store(gl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0))
    fence_async_shared()
    gl.thread_barrier()

    q_pos = context + first + (WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_LAYOUT))) // GROUP
    zero_s = gl.zeros([ROWS, TILE_N], gl.float32, S_LAYOUT)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_LAYOUT)

    mbarrier.wait(k_full.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    gl.thread_barrier()
    mbarrier.arrive(k_empty.index(0), count=1)
    if num_full > 0:
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, 0, q_pos, kv_hi, qk_scale, False, S_LAYOUT)
    else:
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, 0, q_pos, kv_hi, qk_scale, True, S_LAYOUT)
    p_op = gl.convert_layout(p.to(dtype), P_OP)

    for j in range(1, num_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_full.index(stage), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(prev), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(stage), count=1)
        if j < num_full:
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, j * TILE_N, q_pos, kv_hi, qk_scale, False, S_LAYOUT)
        else:
            p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, j * TILE_N, q_pos, kv_hi, qk_scale, True, S_LAYOUT)
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        gl.thread_barrier()
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        p_op = gl.convert_layout(p.to(dtype), P_OP)

    last = (num_tiles - 1) % STAGES
    mbarrier.wait(v_full.index(last), ((num_tiles - 1) // STAGES) & 1)
    valid = kv_hi - (num_tiles - 1) * TILE_N
    if valid < TILE_N:   # both warp groups zero the same rows: identical stores, each before its own product
        zero_tail_rows(v_smem.index(last), valid, TILE_N, HEAD_DIM, 4)
    o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))

    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
    rows_o = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
    token_o = first + rows_o // GROUP
    ok_o = (token_o < q_len) & (rows_o < BLOCK_Q * GROUP)
    o_offs = ((q_start + token_o).to(gl.int64) * stride_ot + (kv_head * GROUP + rows_o % GROUP) * stride_oh)[:, None] \
        + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))[None, :]
    gl.store(out_ptr + o_offs, out.to(dtype), mask=ok_o[:, None])


@gluon.jit
def ws_producer(k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, bt_row, num_tiles, last_block,
                kv_head, NUM_KV_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """The producer warp: every key and value tile of the program by TMA, each into a buffer once both consumer
    warp groups handed it back (a fresh barrier passes the first wait: parity 1 is its phase before the first)."""
    for t in range(num_tiles):
        stage = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(stage), phase)
        copy_tile(k_desc, k_full.index(stage), k_smem.index(stage), bt_row, t, last_block, kv_head, NUM_KV_HEADS,
                  BLOCK_SIZE)
        mbarrier.wait(v_empty.index(stage), phase)
        copy_tile(v_desc, v_full.index(stage), v_smem.index(stage), bt_row, t, last_block, kv_head, NUM_KV_HEADS,
                  BLOCK_SIZE)


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt"])
def prefill_ws_kernel(
    out_ptr, q_ptr, k_desc, v_desc, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, num_seqs, qk_scale,
    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, TILE_N: gl.constexpr, num_warps: gl.constexpr,
):
    """A program: BLOCK_M rows (query token x group head) of one sequence and KV head. A producer warp issues every
    copy, and the two consumer warp groups (64 rows each, the default partition and a worker) run on their own, with
    no barrier across the program, so that one's softmax overlaps the other's products. Registers: 240 a consumer
    thread, 24 for the producer (no spills; 232 for the default partition spilled 8 bytes)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M // 2
    q_block = gl.num_programs(0) - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = find_sequence(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first >= q_len:
        return
    context = gl.load(seq_lens_ptr + seq) - q_len
    kv_hi = context + gl.minimum(first + BLOCK_Q, q_len)
    num_tiles = gl.cdiv(kv_hi, TILE_N)
    num_full = (context + first + 1) // TILE_N
    last_block = (kv_hi - 1) // BLOCK_SIZE
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    q_smem0 = gl.allocate_shared_memory(dtype, [ROWS, HEAD_DIM], q_layout)
    q_smem1 = gl.allocate_shared_memory(dtype, [ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], v_desc.layout)
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (ws_consumer, (0, out_ptr, q_ptr, q_smem0, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_start, q_len,
                       first, context, kv_hi, num_tiles, num_full, kv_head, stride_qt, stride_qh, stride_ot, stride_oh,
                       qk_scale, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_M // 2, TILE_N)),
        (ws_consumer, (1, out_ptr, q_ptr, q_smem1, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_start, q_len,
                       first, context, kv_hi, num_tiles, num_full, kv_head, stride_qt, stride_qh, stride_ot, stride_oh,
                       qk_scale, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_M // 2, TILE_N)),
        (ws_producer, (k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, bt_row, num_tiles,
                       last_block, kv_head, NUM_KV_HEADS, BLOCK_SIZE)),
    ], [4, 1], [240, 24])


def serves(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta: AttentionMetadata, *,
           sliding_window=None, softcap=None) -> bool:
    """Whether this kernel runs a batch: not decode-like (`tuning.is_decode_like`: the decode kernels serve those)
    and `supports`."""
    from .tuning import is_decode_like

    return (not is_decode_like(query.shape[0], meta.block_table.shape[0])
            and supports(query, pages, fmt, meta, sliding_window=sliding_window, softcap=softcap))


def supports(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta: AttentionMetadata, *,
             sliding_window=None, softcap=None) -> bool:
    """Whether this kernel can run a batch: a Hopper GPU, dense pages stored head-major and contiguous,
    bfloat16 or float16 queries, head_dim 64 or 128, blocks of 16 to 128 slots, a group of at most 16 heads, no
    soft-capping or sliding window."""
    if not query.is_cuda or torch.cuda.get_device_capability(query.device)[0] != 9:
        return False
    if fmt.spec.kind != "dense" or query.dtype not in (torch.bfloat16, torch.float16) or softcap or sliding_window:
        return False
    view = page_view(fmt, pages)
    group = query.shape[1] // view.num_kv_heads
    return (query.shape[-1] in (64, 128) and view.k.dtype == query.dtype and meta.block_size in (16, 32, 64, 128)
            and group <= 16 and all(_stored(p) is not None for p in (view.k, view.v)))


def _stored(page: torch.Tensor) -> torch.Tensor | None:
    """A page tensor [num_blocks, block_size, num_kv_heads, head_dim] as the rows [num_blocks * num_kv_heads *
    block_size, head_dim] it is stored as, or None when it is not stored so."""
    if not stored_head_major(page) or page.data_ptr() % 16:
        return None
    return page.transpose(1, 2).reshape(-1, page.shape[-1])


def descriptor(page: torch.Tensor, block_size: int) -> TensorDescriptor:
    rows = _stored(page)
    dtype = gl.bfloat16 if page.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_size, page.shape[-1]], dtype)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_size, page.shape[-1]], layout)


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt, meta: AttentionMetadata, *,
                    scale: float) -> torch.Tensor:
    """`attention.paged_attention` for the batches `supports` accepts."""
    view = page_view(fmt, pages)
    num_tokens, num_q_heads, head_dim = query.shape
    group = num_q_heads // view.num_kv_heads
    block_q = BLOCK_M // group
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    num_seqs = meta.block_table.shape[0]
    grid = (num_tokens // block_q + num_seqs, view.num_kv_heads)
    prefill_ws_kernel[grid](
        out, query, descriptor(view.k, meta.block_size), descriptor(view.v, meta.block_size),
        meta.block_table, meta.seq_lens, meta.query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        num_seqs, float(scale) * LOG2E,
        NUM_KV_HEADS=view.num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=meta.block_size,
        BLOCK_M=BLOCK_M, BLOCK_Q=block_q, TILE_N=TILE_N, num_warps=4)   # the default partition: a consumer
    return out
