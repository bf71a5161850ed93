"""The Gluon decode kernels (`ops/triton/decode_gluon.py`: q8, q6, q4, TurboQuant and `off`, all serving by default)
against the reference path, on a CUDA device.

Gluon has no interpreter: on the CPU, `test_sm90_compile.py` compiles them for sm_90 and checks their loops
(every page byte loaded into the matrix units' registers, no shared memory).
"""

import pytest
import torch

from pagedkv.ops import reference
from triton_cases import build_case, rel_err

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 4 and 8; head_dim 64 and 128; blocks of 16 and 32
SHAPES = [(2, 2, 64, 16), (8, 2, 128, 16), (8, 1, 64, 32), (32, 8, 128, 16)]
# decode tokens, a verify-like run of 3 and a prefill chunk in one batch, one sequence without new tokens
CTX_LENS = [0, 37, 70, 20, 9, 300]
NEW_LENS = [5, 1, 3, 1, 0, 1]
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


TQ_SHAPES = [(8, 2, 128, 16), (4, 4, 128, 16), (8, 1, 128, 32), (32, 8, 128, 16)]   # TurboQuant, q4: head_dim 128
TQ_SPECS = ["turboquant", "turboquant:k=q8_0,v=q3_0,rotate_keys", "turboquant:k=q4_0,v=q4_0",
            "turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant:k=q8_0,v=q4_0", "turboquant:k=q4_0,v=q3_0"]
# (format, kernel name in decode_gluon.KERNELS, shape)
CASES = ([("q8", "q8", shape) for shape in SHAPES] + [("off", "off", shape) for shape in SHAPES]
         + [("q4", "q4", shape) for shape in TQ_SHAPES] + [("q6", "q6", shape) for shape in TQ_SHAPES]
         + [(spec, "turboquant", shape) for spec in TQ_SPECS for shape in TQ_SHAPES])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec,kernel,shape", CASES,
                         ids=lambda c: "q{}kv{}d{}bs{}".format(*c) if isinstance(c, tuple) else c)
def test_gluon_decode_matches_reference(spec, kernel, shape, num_splits, dtype):
    check_against_reference(hash((spec, shape)) % 1000, spec, kernel, shape, dtype, num_splits=num_splits)


def check_against_reference(seed, spec, kernel, shape, dtype, **options):
    """Kernel `kernel` of decode_gluon.KERNELS (launched with `options`) against the reference path on a batch of
    decodes, a verify-like run and a prefill chunk of format `spec` and (query heads, KV heads, head_dim, block)."""
    from pagedkv.ops.triton import decode_gluon

    reads, launch = decode_gluon.KERNELS[kernel]
    hq, hkv, d, bs = shape
    case = build_case(seed, spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=dtype)
    assert reads(case.fmt, case.query, bs)
    scale = d ** -0.5
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
    out = launch(case.query, case.pages, case.fmt, case.meta, scale=scale, **options)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec,kernel,shape", CASES,
                         ids=lambda c: "q{}kv{}d{}bs{}".format(*c) if isinstance(c, tuple) else c)
def test_gluon_decode_with_page_offsets_in_32_bits_matches_reference(spec, kernel, shape, num_splits):
    check_against_reference(hash((spec, shape, 32)) % 1000, spec, kernel, shape, torch.bfloat16,
                            num_splits=num_splits, offsets32=True)


def test_page_offsets_are_32_bits_only_where_asked_and_every_page_tensor_fits():
    """`offsets_in_32_bits`: as asked (None: the module's OFFSETS32), and never when a page tensor has 2^31
    elements or more, where a block's offset could overflow int32 (tensors on the meta device: no memory)."""
    from types import SimpleNamespace

    from pagedkv.ops.triton import decode_gluon

    def view(blocks):
        k = torch.empty(blocks, 16, 8, 128, dtype=torch.int8, device="meta")
        s = torch.empty(blocks, 16, 8, 4, dtype=torch.float16, device="meta")
        return SimpleNamespace(k=k, v=torch.empty(blocks, 16, 8, 48, dtype=torch.int8, device="meta"), k_scale=s,
                               k_zero=s, v_scale=s)

    small, large = view(131071), view(131072)   # keys of 16 x 8 x 128 bytes a block: 2^31 elements at 131,072
    assert decode_gluon.offsets_in_32_bits(True, small)
    assert not decode_gluon.offsets_in_32_bits(True, large)
    assert not decode_gluon.offsets_in_32_bits(False, small)
    assert decode_gluon.offsets_in_32_bits(None, small) == decode_gluon.OFFSETS32


@pytest.mark.parametrize("spec", ["turboquant", "turboquant:k=q4_0,v=q4_0"])
def test_constant_slot_strides_only_where_the_pages_are_head_major(spec):
    """`head_major`: true for the pages the format lays out (`allocate_pages`), false for a slot-major copy of
    them, whose rows are a head apart: TQ_ROWS (`rows=True`) then takes the strides it is given."""
    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops.triton import decode_gluon
    from pagedkv.ops.triton.page_view import page_view

    fmt = make_format(KVFormat.parse(spec), 8, 128, torch.bfloat16, "cpu")
    pages = fmt.allocate_pages(4, 16)
    assert decode_gluon.head_major(page_view(fmt, pages))
    slot_major = {name: t.contiguous() for name, t in pages.items()}   # [block, slot, head, row] in that order
    assert not decode_gluon.head_major(page_view(fmt, slot_major))


# (format, kernel, shape, with a dense recent window): each kernel over its pages, and with a window where it has
# one (dense pages have none)
ORDER_CASES = [(*case, window) for case in CASES if case[2] in ((2, 2, 64, 16), (8, 2, 128, 16)) and case[0] in (
    "q8", "off", "q4", "q6", "turboquant", "turboquant:k=q4_0,v=q4_0")
    for window in ((False,) if case[0] == "off" else (False, True))]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec,kernel,shape,window", ORDER_CASES,
                         ids=lambda c: "q{}kv{}d{}bs{}".format(*c) if isinstance(c, tuple)
                         else {True: "window", False: "pages"}.get(c, c))
def test_gluon_decode_launched_in_any_token_order_matches_reference(spec, kernel, shape, window, num_splits):
    """A token order in the metadata (`metadata.LONGEST_FIRST`'s, here a random one) only changes which programs
    start first (`decode_io.launch_grid`): the outputs are the reference's, with a dense recent window too."""
    import dataclasses

    from pagedkv.ops.triton import decode_gluon
    from test_triton_decode_window import window_case, window_reference

    launch = decode_gluon.KERNELS[kernel][1]
    hq, hkv, d, bs = shape
    if window:
        case, rings = window_case(spec, hq, hkv, d, dtype=torch.float16, seed=len(spec) + d)
        ref = window_reference(dataclasses.replace(case, query=case.query.float()), rings, scale=0.2)
        options, scale = {"window": rings}, 0.2
    else:
        case = build_case(hash((spec, shape)) % 1000, spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                          block_size=bs, ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=torch.float16)
        scale = d ** -0.5
        ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
        options = {}
    num_tokens = case.query.shape[0]
    order = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(num_tokens)).to(torch.int32).cuda()
    meta = dataclasses.replace(case.meta, token_order=order)
    assert decode_gluon.launch_grid(case.query, meta, 1, num_splits, None)[2]
    out = launch(case.query, case.pages, case.fmt, meta, scale=scale, num_splits=num_splits, **options)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pairs", [False, True], ids=["steps_of_16", "steps_of_32"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec,shape", [(spec, shape) for spec in ("q4", "q6", "turboquant", "turboquant:k=q4_0,v=q4_0")
                                        for shape in TQ_SHAPES[:3]],
                         ids=lambda c: "q{}kv{}d{}bs{}".format(*c) if isinstance(c, tuple) else c)
def test_gluon_in_steps_of_16_and_32_keys_matches_reference(spec, shape, num_splits, pairs):
    """The q4 / q6 and TurboQuant kernels in either loop step, whichever is their default
    (`decode_gluon.Q4_PAIRS_BITS`, `TQ_PAIRS`): 16 keys, or 32 (PAIRS, one softmax step for both halves):
    sequences whose keys end in either half of a step, or past it."""
    from pagedkv.ops.triton import decode_gluon

    launch = decode_gluon.KERNELS["turboquant" if spec.startswith("turboquant") else "q4"][1]

    hq, hkv, d, bs = shape
    case = build_case(hash((spec, shape)) % 1000, spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=torch.bfloat16)
    scale = d ** -0.5
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
    out = launch(case.query, case.pages, case.fmt, case.meta, scale=scale, num_splits=num_splits, pairs=pairs)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_dense_decode_with_kv_heads_together_matches_reference(shape, heads, num_splits, dtype):
    """Dense pages with `heads` KV heads in one program, a warp each (`decode_dense_kernel`): every shape's heads in
    groups of up to `heads`."""
    from pagedkv.ops.triton import decode_gluon

    hq, hkv, d, bs = shape
    heads = min(heads, hkv)
    case = build_case(hash(("off", shape)) % 1000, "off", num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      block_size=bs, ctx_lens=CTX_LENS, new_lens=NEW_LENS, dtype=dtype)
    scale = d ** -0.5
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=scale)
    out = decode_gluon.paged_attention_dense(case.query, case.pages, case.fmt, case.meta, scale=scale,
                                             num_splits=num_splits, heads=heads)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,inner", [(1, 2), (1, 4), (2, 2), (2, 4)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_dense_decode_with_splits_inside_a_program_matches_reference(shape, heads, inner, num_splits, dtype):
    """`paged_attention_dense(inner=...)` (`decode_dense_kernel`'s INNER): each program's keys split again among its
    warps and merged in the program, with and without splits across programs (uneven and empty inner splits: the
    batch's sequences hold 0 to 300 keys)."""
    check_against_reference(hash(("inner", shape)) % 1000, "off", "off", shape, dtype, num_splits=num_splits,
                            heads=min(heads, shape[1]), inner=inner)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_dense_decode_laid_out_inside_a_program_matches_reference(shape, num_splits, dtype):
    """`paged_attention_dense(plan=True)` (`decode_gluon.dense_plan`, served where DENSE_INNER): the split rule's
    count laid out inside programs (and across them past four), attention as the reference's."""
    check_against_reference(hash(("plan", shape)) % 1000, "off", "off", shape, dtype, num_splits=num_splits,
                            plan=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_dense_decode_with_block_ids_a_step_ahead_matches_reference(shape, num_splits, dtype):
    """`decode_gluon.DENSE_IDS_AHEAD` (a copy's block id loaded a step before it): attention as the reference's."""
    check_against_reference(hash(("ids", shape)) % 1000, "off", "off", shape, dtype, num_splits=num_splits,
                            ids_ahead=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec", ["turboquant", "turboquant:k=q4_0,v=q4_0"])
@pytest.mark.parametrize("shape", TQ_SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_turboquant_decode_with_block_ids_a_step_ahead_matches_reference(shape, spec, num_splits):
    """`paged_attention_tq(ids_ahead=True)` (16 keys a step): attention as the reference's."""
    check_against_reference(hash(("ids", spec, shape)) % 1000, spec, "turboquant", shape, torch.bfloat16,
                            num_splits=num_splits, pairs=False, ids_ahead=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("options", [{"halves": False}, {"tables": True}, {"tables": True, "offsets32": True},
                                     {"tables": True, "max_registers": 0}, {"rows": True}, {"lane_sums": False},
                                     {"rows": True, "tables": True, "offsets32": True, "lane_sums": True},
                                     {"pairs": True, "rows": True, "tables": True, "offsets32": True,
                                      "lane_sums": True},
                                     {"rows": True, "tables": True, "offsets32": True, "lane_sums": True,
                                      "max_registers": 96},
                                     {"skew": True}, {"skew": True, "lane_sums": False},
                                     {"skew": True, "rows": True, "tables": True, "offsets32": True},
                                     {"skew": True, "stages": 3}],
                         ids=lambda o: "-".join(o))
@pytest.mark.parametrize("spec", ["turboquant", "turboquant:k=q4_0,v=q3_0", "turboquant:k=q4_0,v=q4_0"])
@pytest.mark.parametrize("shape", TQ_SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_turboquant_decode_variants_match_reference(shape, spec, options, num_splits):
    """TurboQuant's decode with its scale columns shifted out (as before TQ_HALVES), with the 3-bit codebook's
    tables in registers (TQ_TABLES; with 32-bit page offsets; uncapped), with constant slot strides (TQ_ROWS), with
    the softmax sums added across the lanes every step (as before LANE_SUMS), all the lean options together, in steps
    of 16 and of 32 keys, capped at 96 registers (20 programs a multiprocessor, a few registers spilled), and its
    loop software-pipelined (TQ_SKEW, with two and three steps in flight; K q4_0 / V q4_0 takes 32-key steps, so
    not skewed): attention as the reference's."""
    check_against_reference(hash(("lean", spec, shape)) % 1000, spec, "turboquant", shape, torch.bfloat16,
                            num_splits=num_splits, **options)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec,options", [("q4", {"offset_keys": False, "lane_sums": False}),
                                          ("q4", {"offset_keys": False}), ("q4", {"lane_sums": False}),
                                          ("q4", {"offset_keys": True, "lane_sums": True, "offsets32": True}),
                                          ("q4", {"lane_sums": True, "pairs": False}), ("q6", {"lane_sums": False}),
                                          ("q4", {"offset_keys": True, "lane_sums": True, "offsets32": True,
                                                  "max_registers": 96}),
                                          ("q4", {"skew": True}), ("q4", {"skew": True, "lane_sums": False}),
                                          ("q4", {"skew": True, "offsets32": True, "max_registers": 0}),
                                          ("q6", {"skew": True, "pairs": True})],
                         ids=lambda c: "-".join(c) if isinstance(c, dict) else c)
@pytest.mark.parametrize("shape", TQ_SHAPES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c))
def test_q4_and_q6_decode_variants_match_reference(shape, spec, options, num_splits, dtype):
    """`paged_attention_q4` as served before Q4_OFFSET_KEYS and LANE_SUMS (neither), with each alone (the sums in
    the lanes in steps of 32 keys and of 16), all together with 32-bit page offsets, and so capped at 96 registers
    (20 programs a multiprocessor); q6 with the sums added across the lanes every step; q4 and q6 in 32-key steps
    with their loop software-pipelined (Q4_SKEW; q4 capped at 128 registers, and uncapped): attention as the
    reference's."""
    check_against_reference(hash(("q4 variants", spec, shape)) % 1000, spec, spec, shape, dtype,
                            num_splits=num_splits, **options)


def test_dense_decode_reads_four_kv_heads_a_program_where_they_divide():
    """`decode_gluon.dense_heads` (CPU): four KV heads a program where four divide them, else one (SmolLM2's three
    KV heads, two)."""
    from pagedkv.ops.triton import decode_gluon

    assert decode_gluon.dense_heads(8) == decode_gluon.dense_heads(4) == 4
    assert decode_gluon.dense_heads(3) == decode_gluon.dense_heads(2) == 1


def test_the_dense_decode_plans_up_to_four_splits_inside_a_program():
    """`decode_gluon.dense_plan` (CPU; served where DENSE_INNER): one split stays one program of four heads; two to
    four go inside a program (a power of two of them at least the splits asked for), more across programs too;
    programs of four warps (as many as the splits across programs made before), or eight where those fill their
    last wave of 132 multiprocessors at least 90% (issue 10's shapes: (32, 4096) at 4 splits, (64, 8192) at 2,
    (128, 2048) at 2, one sequence at 128), not the same-memory run's 40 sequences at 3 (160 programs of eight: 1.2
    waves) or 48 at 2 (96); SmolLM2's three KV heads one a program."""
    from pagedkv.ops.triton import decode_gluon

    def plan(kv, s, tokens=0, head_dim=128, sms=132):
        return decode_gluon.dense_plan(kv, s, tokens, head_dim, sms)

    assert plan(8, 1, 32) == (4, 1, 1)
    assert [plan(8, s, 40) for s in (2, 3, 4, 5, 8, 128)] == [(2, 2, 1), (1, 4, 1), (1, 4, 1), (1, 4, 2), (1, 4, 2),
                                                             (1, 4, 32)]
    assert [plan(8, s, b) for b, s in ((32, 4), (64, 2), (128, 2), (1, 128))] == [(2, 4, 1), (4, 2, 1), (4, 2, 1),
                                                                              (2, 4, 32)]
    assert [plan(8, s, b) for b, s in ((40, 3), (48, 2), (33, 4))] == [(1, 4, 1), (2, 2, 1), (2, 4, 1)]
    assert plan(8, 4, 32, head_dim=64) == plan(8, 4, 32, sms=0) == (1, 4, 1)
    assert [plan(3, s, 32) for s in (1, 2, 4, 6)] == [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 4, 2)]
    for kv, s, b in ((8, 2, 7), (8, 4, 32), (3, 4, 5), (2, 3, 64)):
        heads, inner, outer = plan(kv, s, b)
        assert kv % heads == 0 and heads * inner <= 8 and inner * outer >= s


def test_the_default_gluon_kernels_are_the_timed_ones_and_only_where_they_read():
    """`decode_gluon.launcher` (CPU: shapes and options only): q8, q6, q4, TurboQuant and `off` decode by default
    (DEFAULT_KERNELS, each timed faster), each with its split target; nothing with rotated KV-Quant keys, a window,
    soft-capping, float32 queries or blocks of 5 slots."""
    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops.triton import decode_gluon

    query = torch.empty(4, 8, 128, dtype=torch.bfloat16)
    fmt = {spec: make_format(KVFormat.parse(spec), 2, 128, torch.bfloat16, "cpu")
           for spec in ("q8", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0", "q8:rotate_keys", "off", "q6")}
    assert decode_gluon.launcher(fmt["q8"], query, 16) == (decode_gluon.paged_attention, 8)
    assert decode_gluon.launcher(fmt["q8"], query, 32) == (decode_gluon.paged_attention, 8)
    assert decode_gluon.launcher(fmt["q4"], query, 16) == (decode_gluon.paged_attention_q4, 8)
    assert decode_gluon.launcher(fmt["turboquant"], query, 16) == (decode_gluon.paged_attention_tq, 16)
    assert decode_gluon.launcher(fmt["turboquant:k=q4_0,v=q4_0"], query, 16) == (decode_gluon.paged_attention_tq, 12)
    assert decode_gluon.launcher(fmt["off"], query, 16) == (decode_gluon.paged_attention_dense, 8)
    assert decode_gluon.launcher(fmt["q6"], query, 16) == (decode_gluon.paged_attention_q4, 8)
    assert decode_gluon.launcher(fmt["q8:rotate_keys"], query, 16) is None
    for spec in ("q8", "q6", "q4", "turboquant", "off"):
        assert decode_gluon.launcher(fmt[spec], query, 5) is None
        assert decode_gluon.launcher(fmt[spec], query.float(), 16) is None
        assert decode_gluon.launcher(fmt[spec], query, 16, softcap=30.0) is None
        assert decode_gluon.launcher(fmt[spec], query, 16, sliding_window=64) is None
        assert decode_gluon.launcher(fmt[spec], query, 16, window=(query, query)) is None
    # every kernel reads its own format where timed in: the readers, without the default list
    assert decode_gluon.supports_q4(fmt["q4"], query, 16) and decode_gluon.supports_tq(fmt["turboquant"], query, 16)
    assert decode_gluon.supports_q6(fmt["q6"], query, 16) and not decode_gluon.supports_q4(fmt["q6"], query, 16)
    assert not decode_gluon.supports_tq(fmt["q4"], query, 16) and not decode_gluon.supports_q4(fmt["q8"], query, 16)
    assert decode_gluon.supports_dense(fmt["off"], query, 16) and not decode_gluon.supports_dense(fmt["q8"], query, 16)


def test_a_window_goes_to_the_gluon_kernels_where_they_were_timed_faster():
    """Decode batches with a dense recent window: the Gluon kernels of WINDOW_KERNELS (q4, q6, TurboQuant) from
    WINDOW_MIN_TOKENS query tokens on, `decode.py` for the other formats and smaller batches; every quantized
    kernel reads a window (dense pages never have one)."""
    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops.triton import decode_gluon

    small = torch.empty(decode_gluon.WINDOW_MIN_TOKENS - 1, 8, 128, dtype=torch.bfloat16)
    large = torch.empty(decode_gluon.WINDOW_MIN_TOKENS, 8, 128, dtype=torch.bfloat16)
    specs = ("q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0", "off")
    fmt = {spec: make_format(KVFormat.parse(spec), 2, 128, torch.bfloat16, "cpu") for spec in specs}
    for query in (small, large):
        window = (query, query)
        assert all(decode_gluon.launcher(f, query, 16, window=window) is None for s, f in fmt.items()
                   if s in ("q8", "off") or query is small)
        assert all(decode_gluon.launcher(fmt[s], query, 16) is not None for s in specs)
    window = (large, large)
    assert decode_gluon.launcher(fmt["q6"], large, 16, window=window) == (decode_gluon.paged_attention_q4, 8)
    assert decode_gluon.launcher(fmt["q4"], large, 16, window=window)[0] is decode_gluon.paged_attention_q4
    assert decode_gluon.launcher(fmt["turboquant"], large, 16, window=window) == (decode_gluon.paged_attention_tq, 16)
    assert decode_gluon.launcher(fmt["turboquant:k=q4_0,v=q4_0"], large, 16, window=window)[0] is \
        decode_gluon.paged_attention_tq
    assert decode_gluon.supports(fmt["q8"], large, 16, window=window)
    assert decode_gluon.supports_q4(fmt["q4"], large, 16, window=window)
    assert not decode_gluon.supports_dense(fmt["off"], large, 16, window=window)
    # the token threshold holds for any kernel list (benchmarks pass KERNELS)
    assert decode_gluon.launcher(fmt["q8"], small, 16, kernels=decode_gluon.KERNELS, window=(small, small)) is None


def test_gluon_is_used_only_with_the_triton_it_is_written_for(monkeypatch):
    import triton

    from pagedkv.ops.triton import gluon_available

    assert gluon_available() == (tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6))
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert not gluon_available()
    monkeypatch.setattr(triton, "__version__", "3.7.0+git1234")
    assert gluon_available()


WINDOW_CASES = [("q8", "q8", 64), ("q8", "q8", 128), ("q4", "q4", 128), ("q6", "q6", 128),
                ("turboquant", "turboquant", 128), ("turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant", 128)]


@needs_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("spec,kernel,head_dim", WINDOW_CASES, ids=[f"{s}-d{d}" for s, _, d in WINDOW_CASES])
def test_gluon_decode_reads_the_pages_then_the_window(spec, kernel, head_dim, num_splits):
    """With a dense recent window the Gluon kernels' splits stop where each sequence's window begins and
    `split_k.ring_partials` attends the window as one more split: against the reference reading the same rings
    (all of a sequence from its ring, some, none; a verify-like run of 3)."""
    import dataclasses

    from pagedkv.ops.triton import decode_gluon
    from test_triton_decode_window import window_case, window_reference

    case, rings = window_case(spec, 8, 2, head_dim, dtype=torch.float16, seed=len(spec) + head_dim)
    ref = window_reference(dataclasses.replace(case, query=case.query.float()), rings, scale=0.2)
    out = decode_gluon.KERNELS[kernel][1](case.query, case.pages, case.fmt, case.meta, scale=0.2,
                                          num_splits=num_splits, window=rings)
    assert rel_err(out, ref) < TOL[torch.float16]
    plain = decode_gluon.KERNELS[kernel][1](case.query, case.pages, case.fmt, case.meta, scale=0.2,
                                            num_splits=num_splits)
    assert rel_err(plain, ref) > 2 * rel_err(out, ref)   # the window's exact keys are what brought it closer
