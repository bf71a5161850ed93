"""Varlen paged attention: prefill chunks and decode tokens of many sequences in one launch.

Grid: (query blocks, KV heads). A query block is BLOCK_Q consecutive query tokens of one sequence
times the GROUP query heads that share a KV head, so the keys and values of a tile are read once per
group. The grid is sized from tensor shapes only (num_tokens // BLOCK_Q + num_seqs blocks bound the
real ones from above; the rest exit at once), so a launch never needs a host copy of the lengths and
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.base import PageFormat
from ..metadata import AttentionMetadata
from .page_view import PageView, value_codebook, page_view, stride3
from .tiles import attend_range, find_sequence, load_queries, rotate_rows
from .tuning import TileConfig, choose_tiles, page_class

# Integer arguments that change from step to step. Triton specialises integer arguments on their value
# (== 1, a multiple of 16) and compiles a kernel per combination; a server would then compile again, for
# seconds, mid-stream whenever the batch size or the block-table width first falls into a new class.
PER_STEP_ARGS = ["num_seqs", "stride_bt", "num_splits"]


@triton.jit
def query_block_rows(q_block, kv_head, query_start_loc_ptr, seq_lens_ptr, num_seqs,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Where a program's rows sit: (seq, first token, q_len, context, token [BLOCK_M], head [BLOCK_M], row_ok)."""
    seq = find_sequence(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    context = tl.load(seq_lens_ptr + seq) - q_len
    offs_m = tl.arange(0, BLOCK_M)
    token = first + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (token < q_len) & (offs_m < BLOCK_Q * GROUP)
    return seq, q_start, q_len, first, context, token, head, row_ok


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def paged_attention_kernel(
    out_ptr, q_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr, q_rotation_ptr, out_rotation_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    k_strides, v_strides, ks_strides, vs_strides,   # (block, slot, head) of each page tensor
    num_seqs, qk_scale, softcap, sliding_window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    KIND: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, ROTATE_Q: tl.constexpr, ROTATE_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)   # last blocks (the longest causal rows) start first
    kv_head = tl.program_id(1)
    seq, q_start, q_len, first, context, token, head, row_ok = query_block_rows(
        q_block, kv_head, query_start_loc_ptr, seq_lens_ptr, num_seqs, GROUP, BLOCK_M, BLOCK_Q)
    if first >= q_len:
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = load_queries(q_ptr, q_rows, head, row_ok, stride_qt, stride_qh, q_rotation_ptr,
                     HEAD_DIM, HEAD_DIM_PAD, ROTATE_Q, DOT_PRECISION, KIND)                # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = context + token
    kv_hi = context + tl.minimum(first + BLOCK_Q, q_len)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + first - sliding_window + 1, 0) // TILE_N * TILE_N

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

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if ROTATE_OUT:  # values were accumulated in the rotated domain: rotate each output row back once
        out = rotate_rows(out, out_rotation_ptr, HEAD_DIM, DOT_PRECISION)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch_args(view: PageView, dtype: torch.dtype, rotations: PageView | None = None):
    """The page-tensor arguments every attention kernel takes, in kernel order, for queries of `dtype`; the query
    and output rotations those of `rotations` when given (another format's, see `paged_attention`)."""
    rot = rotations or view
    return (view.k, view.v, view.k_scale, view.k_zero, view.v_scale, value_codebook(view, dtype), rot.aux("q_rotation"),
            rot.aux("out_rotation"))


def check_inputs(query: torch.Tensor, view: PageView, meta: AttentionMetadata) -> None:
    assert query.dim() == 3 and query.stride(-1) == 1, f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}"
    assert query.shape[-1] == view.head_dim, f"query head_dim {query.shape[-1]} != pages' {view.head_dim}"
    assert query.shape[1] % view.num_kv_heads == 0, f"{query.shape[1]} query heads do not group over {view.num_kv_heads} KV heads"
    assert meta.block_table.dtype == torch.int32 and meta.block_table.stride(-1) == 1, "block_table must be int32, row-major"
    assert meta.seq_lens.dtype == torch.int32 and meta.query_start_loc.dtype == torch.int32, "seq_lens/query_start_loc must be int32"
    assert meta.query_start_loc.shape[0] == meta.block_table.shape[0] + 1 == meta.seq_lens.shape[0] + 1, \
        "block_table, seq_lens and query_start_loc disagree on the number of sequences"
    assert meta.block_table.device == query.device == view.k.device, "query, pages and metadata must share a device"


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    tiles: TileConfig | None = None, rotations: PageView | None = None) -> torch.Tensor:
    """Same contract as `reference.paged_attention`: query [num_tokens, num_q_heads, head_dim] ->
    [num_tokens, num_q_heads, head_dim] in query.dtype. `tiles` overrides the tile shape (benchmarks).
    `rotations`: the query and output rotations of another format's pages (`dense_prefill`: dense pages holding
    that format's attention domain), applied in registers."""
    view = page_view(fmt, pages)
    rot = rotations or view
    check_inputs(query, view, meta)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = meta.block_table.shape[0]
    group = num_q_heads // view.num_kv_heads
    tiles = tiles or choose_tiles(num_tokens, num_seqs, group, head_dim, query.device,
                                  pages=page_class(fmt), dtype=query.dtype)
    block_q = tiles.block_m // group
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    grid = (num_tokens // block_q + num_seqs, view.num_kv_heads)
    paged_attention_kernel[grid](
        out, query, *launch_args(view, query.dtype, rot),
        meta.block_table, meta.seq_lens, meta.query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale),
        num_seqs, float(scale), float(softcap or 1.0), int(sliding_window or 0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=meta.block_size,
        BLOCK_M=tiles.block_m, BLOCK_Q=block_q, TILE_N=tiles.tile_n,
        USE_SOFTCAP=bool(softcap), USE_WINDOW=bool(sliding_window),
        KIND=view.kind, K_BITS=view.k_bits, V_BITS=view.v_bits, ROTATE_Q=rot.rotate_keys, ROTATE_OUT=rot.rotate_out,
        DOT_PRECISION=dot_precision(query.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
