"""Prefill over quantized pages as over dense ones: the context a batch reads is dequantized once into dense
scratch pages, then the varlen kernel for dense pages runs over them.

The fused kernels convert a key and value tile every time a query block reads it: a 2,048-token chunk over 8K
tokens of context converts each context tile once per query block of its sequence (16-32 times), and measured
1.7-2.8x `off`'s prefill time on an H200. Here each block is converted once (one program per block and KV head,
with the fused kernels' own `codecs.load_keys` / `load_values`) into the queries' dtype, and the dense kernel
runs at `off`'s speed over it. Keys and values are rebuilt in the queries' dtype (bfloat16 keeps 8 mantissa
bits, as `off`'s own pages do); the dense kernel rotates the query into the keys' domain (rotated keys) and
the output out of the values' (TurboQuant) in registers, or on Hopper, where the Gluon prefill kernel
(`prefill_gluon.py`) runs, two matrix products in the queries' dtype around it do.

A step of continuous batching holds decodes, then prefill chunks (`engine/scheduler.py`): the decodes run the
decode kernels as a batch of their own, the chunks this path (`step_of`). A dense recent window
(`recent_tokens`) is read too: each sequence's blocks from its first ring block on come from its ring. The
fused kernels do not read rings, so a step with a window takes this path for chunks of any length, or whole
when it does not split into decodes the decode kernel reads then chunks (`windowed_start`).

Scratch: every context block of the chunks' sequences, keys and values, in the queries' dtype (a 2,048-token
chunk over 8K tokens of context at 8 KV heads x 128: 42 MB), so only chunks whose blocks stay within
`MAX_TOKENS` take this path; the plan (which block goes where) is built from host lists, once per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ...config import KVFormat
from ...formats import make_format
from ...formats.base import PageFormat, empty_pages
from .. import metadata
from ..metadata import AttentionMetadata, WindowPlan
from .codecs import KVQUANT, load_keys, load_token_scales, load_values
from . import tuning
from .page_view import page_view, stride3, value_codebook
from .tuning import WINDOW_MAX_NEW_TOKENS, choose_tiles, is_decode_like, launch_fitting

MAX_TOKENS = 131072          # context tokens (all sequences) a batch may dequantize: 512 MB at 8 x 128 bf16
MIN_TOKENS_PER_SEQ = 64      # new tokens per sequence below which the fused kernels convert less


def chunk_start(meta: AttentionMetadata, min_tokens: int = MIN_TOKENS_PER_SEQ) -> int | None:
    """The first sequence of the batch's prefill chunks when they take this path, else None. A batch is decodes
    (at most two new tokens each) then chunks, as the engine's scheduler orders them; the chunks need at least
    `min_tokens` new tokens per sequence on average and at most MAX_TOKENS context tokens to dequantize."""
    qsl = meta.query_start_loc_cpu
    new = [b - a for a, b in zip(qsl, qsl[1:])]
    start = 0
    while start < len(new) and new[start] <= 2:
        start += 1
    if start == len(new) or min(new[start:]) <= 2:
        return None
    if qsl[-1] - qsl[start] < min_tokens * (len(new) - start) or not fits(meta, start):
        return None
    return start


def fits(meta: AttentionMetadata, start: int) -> bool:
    """Whether the context of sequences start.. is at most MAX_TOKENS tokens of scratch."""
    bs = meta.block_size
    return sum((n + bs - 1) // bs for n in meta.seq_lens_cpu[start:]) * bs <= MAX_TOKENS


def windowed_start(fmt: PageFormat, meta: AttentionMetadata) -> int | None:
    """`chunk_start` for a step with a dense recent window, where the fused kernels cannot go (they do not read
    it): steps the decode kernel reads whole (decode-like, or verify steps of at most WINDOW_MAX_NEW_TOKENS new
    tokens per sequence) stay there unless their chunks are long (`chunk_start`); the chunks of others take this
    path whatever their length, the decodes before them the decode kernel; a batch that does not split so (a
    short chunk among decodes, a format the decode kernel does not read) takes it whole."""
    from .decode import is_supported

    qsl = meta.query_start_loc_cpu
    longest = max(b - a for a, b in zip(qsl, qsl[1:]))
    if not is_supported(fmt):
        return 0 if fits(meta, 0) else None
    if is_decode_like(qsl[-1], len(qsl) - 1) or longest <= WINDOW_MAX_NEW_TOKENS:
        return chunk_start(meta)
    start = chunk_start(meta, min_tokens=0)
    return 0 if start is None and fits(meta, 0) else start


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it where its data does not start on 16 bytes. Triton compiles a kernel once per
    combination of its pointer arguments' 16-byte alignment, so a slice from row lo (lo not a multiple of 4
    for int32 rows) would compile every kernel it reaches again, for 0.3-0.6 s on an H200, mid-stream: the first
    mixed step whose decodes are not a multiple of four (`part`)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def part(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    """The metadata of sequences lo..hi-1 of a batch (their queries: query_start_loc_cpu[lo]..[hi]); its device
    tensors start on 16 bytes, as the whole batch's do (`aligned`). A part of equally many new tokens per sequence
    (a mixed step's decodes) gets the launch order decode steps get (`metadata.launch_order`), so that its decode
    kernels are the variants the CUDA graphs compiled, not others compiled mid-stream."""
    qsl = meta.query_start_loc_cpu
    new_tokens = [b - a for a, b in zip(qsl[lo:hi], qsl[lo + 1:hi + 1])]
    window = meta.window
    if window is not None:
        window = WindowPlan(window.token_index, window.slot_mapping, aligned(window.rows[lo:hi]),
                            aligned(window.first_block[lo:hi]), window.rows_cpu[lo:hi], window.first_block_cpu[lo:hi],
                            window.num_ring_blocks)
    return AttentionMetadata(aligned(meta.block_table[lo:hi]), aligned(meta.seq_lens[lo:hi]),
                             meta.query_start_loc[lo:hi + 1] - qsl[lo],
                             meta.slot_mapping, None, meta.seq_lens_cpu[lo:hi], [x - qsl[lo] for x in qsl[lo:hi + 1]],
                             meta.block_size, phase_hint=meta.phase_hint, window=window,
                             token_order=metadata.launch_order(meta.seq_lens_cpu[lo:hi], new_tokens, meta.seq_lens.device))


@triton.jit(do_not_specialize=["stride_bt"])   # the block table's width changes from step to step (`attention.py`)
def dequantize_kernel(
    k_out, v_out, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, codebook_ptr, q_rotation_ptr, out_rotation_ptr,
    block_table_ptr, rows_ptr, stride_bt, k_strides, v_strides, ks_strides, vs_strides, o_strides,
    rk_ptr, rv_ptr, ring_rows_ptr, ring_first_ptr, r_strides,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_SIZE_PAD: tl.constexpr,
    KIND: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    RING: tl.constexpr, NUM_RING_BLOCKS: tl.constexpr, ROTATE_Q: tl.constexpr, ROTATE_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Scratch block r (program 0) of KV head `head` (program 1) <- block table entry rows[r] = (seq, j): from
    the pages, or with RING from the sequence's dense recent window when j is at or past its first ring block
    (exact keys and values, taken into the pages' attention domain: k R for rotated keys, v R_v for TurboQuant
    values, the rotations `page_view` keeps)."""
    r = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    seq = tl.load(rows_ptr + 2 * r)
    j = tl.load(rows_ptr + 2 * r + 1)
    slot = tl.arange(0, BLOCK_SIZE_PAD)
    ok = slot < BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM)
    DTYPE: tl.constexpr = k_out.dtype.element_ty
    rows = slot.to(tl.int64)[:, None]
    out = r.to(tl.int64) * o_strides[0] + rows * o_strides[1] + head * o_strides[2] + offs_d[None, :]
    from_ring = False
    if RING:
        from_ring = j >= tl.load(ring_first_ptr + seq)
    if from_ring:
        ring_block = tl.load(ring_rows_ptr + seq).to(tl.int64) * NUM_RING_BLOCKS + j % NUM_RING_BLOCKS
        at = ring_block * r_strides[0] + rows * r_strides[1] + head * r_strides[2] + offs_d[None, :]
        k = tl.load(rk_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(rv_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        square = offs_d[:, None] * HEAD_DIM + offs_d[None, :]
        if ROTATE_Q:     # keys as the pages hold them: k R (q_rotation: q_rot = q R)
            k = tl.dot(k, tl.load(q_rotation_ptr + square), input_precision=DOT_PRECISION)
        if ROTATE_OUT:   # values in their rotated domain: v R_v, R_v the transpose of out_rotation
            v = tl.dot(v, tl.trans(tl.load(out_rotation_ptr + square)), input_precision=DOT_PRECISION)
    else:
        block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + j).to(tl.int64)
        blocks = tl.zeros([BLOCK_SIZE_PAD], dtype=tl.int64) + block
        k_ptr += head * k_strides[2]
        v_ptr += head * v_strides[2]
        ks_ptr += head * ks_strides[2]
        kz_ptr += head * ks_strides[2]
        vs_ptr += head * vs_strides[2]
        page_k = (k_strides[0], k_strides[1])
        page_s = (ks_strides[0], ks_strides[1])
        k = load_keys(k_ptr, ks_ptr, kz_ptr, blocks, slot, ok, page_k, page_s, HEAD_DIM, HEAD_DIM, KIND, K_BITS,
                      DTYPE).to(tl.float32)
        v = load_values(v_ptr, vs_ptr, codebook_ptr, blocks, slot, ok, (v_strides[0], v_strides[1]),
                        (vs_strides[0], vs_strides[1]), HEAD_DIM, HEAD_DIM, KIND, V_BITS, DTYPE).to(tl.float32)
        if KIND == KVQUANT:   # integer codes: one scale per slot
            k = k * load_token_scales(ks_ptr, blocks, slot, ok, page_s)[:, None]
            v = v * load_token_scales(vs_ptr, blocks, slot, ok, (vs_strides[0], vs_strides[1]))[:, None]
    tl.store(k_out + out, k.to(DTYPE), mask=ok[:, None])
    tl.store(v_out + out, v.to(DTYPE), mask=ok[:, None])


class Plan:
    """Where each sequence's context blocks go in the scratch: `rows` [num_blocks, 2] int32 (sequence, column of
    its block table) per scratch block, and the scratch's own block table [num_seqs, max_blocks] int32."""

    def __init__(self, meta: AttentionMetadata):
        # numpy, not Python lists: the first layer of a step builds it while the GPU waits (64 sequences of 8,192
        # tokens, 32,768 blocks: 20 ms in lists on a 2-core CPU)
        bs = meta.block_size
        counts = (np.asarray(meta.seq_lens_cpu, dtype=np.int64) + bs - 1) // bs
        self.num_blocks = total = int(counts.sum())
        width = int(counts.max(initial=0)) or 1
        firsts = np.cumsum(counts) - counts                  # each sequence's first scratch block
        seqs = np.repeat(np.arange(len(counts)), counts)
        rows = np.stack([seqs, np.arange(total) - firsts[seqs]], axis=1) if total else np.zeros((1, 2), np.int64)
        table = np.zeros((len(counts), width), dtype=np.int32)   # scratch block j of a sequence at column j, then 0
        table[np.arange(width)[None, :] < counts[:, None]] = np.arange(total)
        device = meta.block_table.device
        self.rows = torch.from_numpy(rows.astype(np.int32)).to(device, non_blocking=True)
        self.table = torch.from_numpy(table).to(device, non_blocking=True)


@dataclass
class Step:
    """How a step's batch splits: the decodes before `start` (their metadata, None when there are none) and the
    chunks from it (their metadata and scratch plan)."""
    start: int
    decodes: AttentionMetadata | None
    chunks: AttentionMetadata
    plan: Plan


_step: tuple | None = None   # the current step's metadata, format and split


def step_of(fmt: PageFormat, meta: AttentionMetadata) -> Step | None:
    """The step's split when its chunks take this path (`tuning.DENSE_PREFILL`), else None: quantized pages at
    power-of-two head_dim, `chunk_start`, or with a dense recent window `windowed_start`. Made by the first layer
    of a step, reused by the others."""
    global _step
    if not tuning.DENSE_PREFILL or fmt.spec.kind == "dense" or fmt.head_dim & (fmt.head_dim - 1):
        return None
    if _step is None or _step[0] is not meta or _step[1] != fmt.spec:
        start = chunk_start(meta) if meta.window is None else windowed_start(fmt, meta)
        step = None
        if start == 0:
            step = Step(0, None, meta, Plan(meta))
        elif start is not None:
            chunks = part(meta, start, len(meta.seq_lens_cpu))
            step = Step(start, part(meta, 0, start), chunks, Plan(chunks))
        _step = (meta, fmt.spec, step)
    return _step[2]


@functools.lru_cache(maxsize=None)
def dense_format(num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> PageFormat:
    return make_format(KVFormat.parse("off"), num_kv_heads, head_dim, dtype, device)


def dequantize(pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata, dtype: torch.dtype,
               plan: Plan | None = None, window: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The context blocks of the batch's sequences as dense scratch pages (keys, values), each
    [plan.num_blocks, block_size, num_kv_heads, head_dim] in `dtype`, in the order of `plan`, in the pages'
    attention domain; with `window` (a dense recent window's rings, `meta.window` its plan), each sequence's
    blocks from its first ring block on come from its ring."""
    plan = plan or Plan(meta)
    view = page_view(fmt, pages)
    shape = (max(plan.num_blocks, 1), meta.block_size, view.num_kv_heads, view.head_dim)
    k_out, v_out = (empty_pages(*shape, dtype, view.k.device) for _ in range(2))   # head-major, as pages are
    if window is not None:
        assert meta.window is not None, "reading a dense recent window needs the step's plan of it (meta.window)"
        rk, rv = (r.flatten(0, 1) for r in window)   # [num_rows * num_ring_blocks, block_size, H, D]
        ring = (rk, rv, meta.window.rows, meta.window.first_block, stride3(rk))
        num_ring_blocks = meta.window.num_ring_blocks
    else:
        ring = (view.k, view.k, meta.seq_lens, meta.seq_lens, (0, 0, 0))
        num_ring_blocks = 1
    if plan.num_blocks:
        dequantize_kernel[(plan.num_blocks, view.num_kv_heads)](
            k_out, v_out, view.k, view.v, view.k_scale, view.k_zero, view.v_scale, value_codebook(view, dtype),
            view.aux("q_rotation"), view.aux("out_rotation"), meta.block_table, plan.rows, meta.block_table.stride(0),
            stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale), stride3(k_out), *ring,
            HEAD_DIM=view.head_dim, BLOCK_SIZE=meta.block_size,
            BLOCK_SIZE_PAD=max(16, triton.next_power_of_2(meta.block_size)),
            KIND=view.kind, K_BITS=view.k_bits, V_BITS=view.v_bits, RING=window is not None,
            NUM_RING_BLOCKS=num_ring_blocks, ROTATE_Q=view.rotate_keys, ROTATE_OUT=view.rotate_out,
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    return k_out, v_out


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    window: tuple[torch.Tensor, torch.Tensor] | None = None, plan: Plan | None = None) -> torch.Tensor:
    """Same contract as `attention.paged_attention`, through dense scratch pages; `window`: the layer's dense
    recent window, read as `decode.paged_attention` reads it; `plan`: the step's (`step_of`), else made here.
    The scratch holds the pages' attention domain: the dense kernel rotates the query into it and the output
    back out of it in registers, with the format's own rotations (the reference path's `fmt.attention_query` /
    `fmt.attention_output`)."""
    from . import attention
    from .gluon_support import gluon_prefill

    plan = plan or Plan(meta)
    k, v = dequantize(pages, fmt, meta, query.dtype, plan, window)
    dense_meta = AttentionMetadata(plan.table, meta.seq_lens, meta.query_start_loc, meta.slot_mapping, meta.token_index,
                                   meta.seq_lens_cpu, meta.query_start_loc_cpu, meta.block_size)
    dense = dense_format(fmt.num_kv_heads, fmt.head_dim, query.dtype, query.device)
    group = query.shape[1] // fmt.num_kv_heads
    rotations = page_view(fmt, pages)   # the query into the keys' domain, the output out of the values', in registers
    scratch = {"k": k, "v": v}
    if gluon_prefill(query, scratch, dense, dense_meta, sliding_window=sliding_window, softcap=softcap):
        # the Gluon kernel has no rotations: the query and output are rotated around it, on the matrix units in the
        # query's dtype (float32 products took 0.1 ms for a 2,048-token chunk at 32 x 128 on an H200)
        from . import prefill_gluon

        if rotations.rotate_keys:
            query = query @ rotations.q_rotation.to(query.dtype)
        out = prefill_gluon.paged_attention(query, scratch, dense, dense_meta, scale=scale)
        if rotations.rotate_out:
            out = out @ rotations.out_rotation.to(out.dtype)
        return out

    def launch(t):
        return attention.paged_attention(query, scratch, dense, dense_meta, scale=scale,
                                         sliding_window=sliding_window, softcap=softcap, tiles=t, rotations=rotations)

    tiles = choose_tiles(query.shape[0], meta.block_table.shape[0], group, fmt.head_dim, query.device,
                         dtype=query.dtype)
    # tiles that do not fit a GPU's shared memory (99 KB a program on sm_89) step down, as the other kernels' do
    return launch_fitting(launch, tiles, group, ("dense-prefill", query.device, query.dtype, dense.spec, fmt.head_dim))
