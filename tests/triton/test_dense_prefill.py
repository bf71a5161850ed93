"""Prefill over quantized pages through dense scratch pages (`ops/triton/dense_prefill.py`) against the reference
path: the context dequantized once per block and KV head, then the dense varlen kernel."""

import pytest
import torch

from pagedkv.ops import reference
from pagedkv.ops import triton as triton_ops
from pagedkv.ops.triton import dense_prefill, tuning
from triton_cases import build_case, rel_err, specialization

SPECS = ["q8", "q6", "q4", "q4:rotate_keys", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys",
         "turboquant:k=q8_0,v=q4_0"]
# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 4 and 1, head_dim 64 and 128, a block size of 5
SHAPES = [(8, 2, 64, 16), (4, 4, 128, 5)]
# a chunk after context, a first chunk, a short one: 70 / 64 / 6 new tokens
CTX_LENS, NEW_LENS = [37, 0, 20], [70, 64, 6]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}kv{}d{}bs{}".format(*s))
@pytest.mark.parametrize("spec", SPECS)
def test_dense_prefill_matches_reference(spec, shape):
    hq, hkv, d, bs = shape
    case = build_case(hash((spec, shape)) % 1000, spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5)
    out = dense_prefill.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5)
    assert rel_err(out, ref) < 1e-5


def test_dense_prefill_options_and_half_precision():
    """Sliding window and softcap pass through to the dense kernel; float16 queries rebuild the pages in float16."""
    case = build_case(3, "turboquant", num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=torch.float16)
    options = dict(scale=0.125, sliding_window=19, softcap=4.0)
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, **options)
    out = dense_prefill.paged_attention(case.query, case.pages, case.fmt, case.meta, **options)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 2e-3


def test_dequantize_writes_each_block_of_each_sequence_once():
    """The scratch holds every context block of every sequence in plan order, equal to the format's decode."""
    case = build_case(4, "q4", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=CTX_LENS,
                      new_lens=NEW_LENS)
    plan = dense_prefill.Plan(case.meta)
    assert plan.num_blocks == sum(-(-n // 16) for n in case.meta.seq_lens_cpu) == plan.rows.shape[0]
    k, v = dense_prefill.dequantize(case.pages, case.fmt, case.meta, torch.float32, plan)
    for r, (seq, j) in enumerate(plan.rows.tolist()):
        block = int(case.meta.block_table[seq, j])
        keys, values = case.fmt.decode({name: t[block] for name, t in case.pages.items()})
        used = min(16, case.meta.seq_lens_cpu[seq] - 16 * j)   # slots past a sequence's end were never written
        assert torch.allclose(k[r, :used], keys[:used], atol=1e-6) and torch.allclose(v[r, :used], values[:used], atol=1e-6)
    assert plan.table[0, :7].tolist() == list(range(7)) and plan.table[1, 0] == 7   # 107 tokens: 7 blocks, then 64


def test_plan_puts_each_sequences_blocks_in_turn():
    """The scratch plan of ragged lengths, an empty sequence among them: (sequence, block-table column) per scratch
    block, in turn, and each sequence's scratch blocks in its table row, padded with 0."""
    from pagedkv.ops.metadata import AttentionMetadata

    lens, qsl = [0, 5, 33, 16, 17], [0, 1, 2, 3, 4, 5]
    meta = AttentionMetadata(torch.zeros(5, 4, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(qsl, dtype=torch.int32), torch.zeros(5, dtype=torch.int64), None, lens, qsl, 16)
    plan = dense_prefill.Plan(meta)
    assert plan.num_blocks == 7
    assert plan.rows.dtype == plan.table.dtype == torch.int32
    assert plan.rows.tolist() == [[1, 0], [2, 0], [2, 1], [2, 2], [3, 0], [4, 0], [4, 1]]
    assert plan.table.tolist() == [[0, 0, 0], [0, 0, 0], [1, 2, 3], [4, 0, 0], [5, 6, 0]]


def test_which_part_of_a_batch_takes_the_path(monkeypatch):
    def start(new_lens, spec="q8"):
        case = build_case(5, spec, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                          ctx_lens=[100] * len(new_lens), new_lens=new_lens)
        step = dense_prefill.step_of(case.fmt, case.meta)
        return None if step is None else step.start

    assert start([64, 70]) == 0                  # prefill chunks only
    assert start([1, 2, 64, 70]) == 2            # decodes first, then chunks (the scheduler's order)
    assert start([1, 1]) is None                 # decodes only: the decode kernels
    assert start([64, 1, 70]) is None            # a decode after a chunk: not split
    assert start([1, 80, 8]) is None             # chunks of 44 tokens on average: the fused kernels convert less
    assert start([64, 70], "off") is None        # dense pages need no conversion
    monkeypatch.setattr(dense_prefill, "MAX_TOKENS", 200)
    assert start([64, 70]) is None               # scratch over its budget
    assert start([1, 1, 64]) == 2                # the chunk's own context is within it


def test_dispatch_takes_the_path_when_enabled(monkeypatch):
    case = build_case(6, "q6", num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=[30, 5],
                      new_lens=[64, 70])
    calls = []
    real = dense_prefill.paged_attention
    monkeypatch.setattr(dense_prefill, "paged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(tuning, "DENSE_PREFILL", True)
    out = triton_ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    assert calls == [1]
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    assert rel_err(out, ref) < 1e-5


def test_a_mixed_batch_splits_into_its_decodes_and_its_chunks(monkeypatch):
    """Decodes then prefill chunks in one step (continuous batching): the decodes run the decode kernel as a batch
    of their own, the chunks go through dense scratch pages; together equal to the reference."""
    from pagedkv.ops.triton import decode

    case = build_case(9, "q4", num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=[50, 9, 33, 0],
                      new_lens=[1, 1, 70, 66])
    seen = {"dense": [], "decode": []}
    real_dense, real_decode = dense_prefill.paged_attention, decode.paged_attention
    monkeypatch.setattr(dense_prefill, "paged_attention",
                        lambda q, *a, **kw: seen["dense"].append(q.shape[0]) or real_dense(q, *a, **kw))
    monkeypatch.setattr(decode, "paged_attention",
                        lambda q, *a, **kw: seen["decode"].append(q.shape[0]) or real_decode(q, *a, **kw))
    monkeypatch.setattr(tuning, "DENSE_PREFILL", True)
    out = triton_ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    assert seen == {"dense": [136], "decode": [2]}
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("num_decodes", [1, 2, 3, 4, 5])
def test_a_mixed_batchs_parts_start_on_16_bytes(num_decodes):
    """Triton compiles a kernel again for each 16-byte alignment of its pointer arguments: the chunks' part of a
    mixed step must not be a slice from row `num_decodes` (a new compile, 0.3-0.6 s on an H200, at the first step
    whose decodes are not a multiple of four), so its device tensors are copies where a slice would be misaligned;
    same values, each specialized as a 16-byte-aligned pointer."""
    from test_triton_decode_window import window_case

    n = num_decodes + 2
    case, _ = window_case("q4", 4, 2, 64, ctx_lens=[40] * n, new_lens=[1] * num_decodes + [70, 64],
                          first_blocks=[1] * n, num_ring_blocks=6)
    meta = case.meta
    for lo, hi in [(0, num_decodes), (num_decodes, n)]:
        sub = dense_prefill.part(meta, lo, hi)
        for whole, piece in [(meta.block_table, sub.block_table), (meta.seq_lens, sub.seq_lens),
                             (meta.window.rows, sub.window.rows), (meta.window.first_block, sub.window.first_block)]:
            assert torch.equal(piece, whole[lo:hi])
            assert specialization(piece) == ("*i32", "D")   # a pointer known to be 16-byte aligned
        assert sub.seq_lens_cpu == meta.seq_lens_cpu[lo:hi]
    assert specialization(meta.seq_lens[1:]) == ("*i32", "")   # what a plain slice would compile


def test_a_steps_layers_share_its_split_and_plan(monkeypatch):
    """The first layer of a mixed step splits it and plans the scratch; the other layers reuse both (the decodes'
    part must not replace the step's record)."""
    case = build_case(9, "q4", num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, ctx_lens=[50, 9, 33, 0],
                      new_lens=[1, 1, 70, 66])
    plans = []
    real = dense_prefill.Plan.__init__
    monkeypatch.setattr(dense_prefill.Plan, "__init__", lambda self, meta: plans.append(meta) or real(self, meta))
    monkeypatch.setattr(tuning, "DENSE_PREFILL", True)
    outs = [triton_ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125) for _ in range(3)]
    assert len(plans) == 1
    assert torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("spec,head_dim", [("q8", 64), ("q4:rotate_keys", 64), ("turboquant", 128),
                                           ("turboquant:k=q4_0,v=q4_0,rotate_keys", 128)])
def test_dense_prefill_reads_the_dense_recent_window(spec, head_dim):
    """With a window, each sequence's blocks from its first ring block on come from its ring (exact keys and
    values, taken into the pages' attention domain), the ones before from the pages: as the reference path."""
    from test_triton_decode_window import window_case, window_reference

    case, rings = window_case(spec, 8, 2, head_dim, seed=7)
    ref = window_reference(case, rings, scale=0.2)
    out = dense_prefill.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.2, window=rings)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("new_lens,first", [([64, 70], [3, 1]), ([1, 70], [1, 1]), ([70, 1], [1, 0]), ([1, 20], [1, 1])],
                         ids=["chunks", "decode_and_chunk", "chunk_then_decode", "short_chunk"])
def test_prefill_with_a_window_takes_the_path_instead_of_the_reference(monkeypatch, new_lens, first):
    """A prefill step over a dense recent window, which the decode kernel does not read, runs the reference path;
    with `tuning.DENSE_PREFILL` it runs through dense scratch pages, rings included (and a decode before the
    chunk through the decode kernel, its ring too)."""
    from pagedkv import ops
    from test_triton_decode_window import window_case, window_reference

    case, rings = window_case("q4", 8, 2, 64, seed=8, ctx_lens=[40, 0], new_lens=new_lens, first_blocks=first,
                              num_ring_blocks=6)
    expected = window_reference(case, rings, scale=0.125)
    calls = []
    real = dense_prefill.paged_attention
    monkeypatch.setattr(dense_prefill, "paged_attention", lambda *a, **kw: calls.append(kw["window"]) or real(*a, **kw))
    monkeypatch.setattr(triton_ops, "supports", lambda device, fmt: (True, None))
    monkeypatch.setattr(tuning, "DENSE_PREFILL", True)
    out = ops.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.125, window=rings)
    assert len(calls) == 1 and calls[0] is rings
    assert rel_err(out, expected) < 1e-5


def test_a_window_splits_a_step_only_where_the_decode_kernel_reads_it():
    """With a dense recent window the fused kernels cannot serve a chunk: the decodes before the chunks go to the
    decode kernel where it reads the window over these pages (not TurboQuant at head_dim 64: the step goes
    whole, even a decode step), chunks of any length take the path, steps the decode kernel reads whole (decodes,
    short verify steps) stay there, and a step that does not split in order goes whole."""
    from test_triton_decode_window import window_case

    def start(spec, head_dim=64, **change):
        lens = dict(dict(ctx_lens=[40, 0], new_lens=[1, 70], first_blocks=[1, 1], num_ring_blocks=6), **change)
        case, _ = window_case(spec, 4, 2, head_dim, **lens)
        step = dense_prefill.step_of(case.fmt, case.meta)
        return None if step is None else (step.start, step.decodes is None)

    assert start("q4") == (1, False)
    assert start("turboquant") == (0, True)                            # the decode kernel does not read these pages
    assert start("turboquant", new_lens=[1, 1], first_blocks=[1, 0]) == (0, True)   # nor their decode steps
    assert start("turboquant", new_lens=[64, 70]) == (0, True)
    assert start("q4", new_lens=[1, 20]) == (1, False)                 # a short chunk: still not the fused kernels
    assert start("q4", new_lens=[4, 4], first_blocks=[1, 0]) is None   # a verify step: the decode kernel reads it
    assert start("q4", new_lens=[1, 1], first_blocks=[1, 0]) is None   # decodes
    assert start("q4", new_lens=[70, 1], first_blocks=[1, 0]) == (0, True)   # a decode after a chunk: whole
