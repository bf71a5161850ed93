"""The kernels compile for an H100/H200 (sm_90), and the dense decode tiles fit four resident programs.

The interpreter the CPU tests run under never lowers a kernel to the GPU, so a kernel that only fails
to compile for the GPU would pass every other CPU test. `bench/kernel_report.py` compiles through the
real host wrappers for sm_90 with Triton's own toolchain and launches nothing; it runs in a subprocess
because this test session has chosen the interpreter before Triton was imported.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant:k=q5_0,v=q2_0",
           "turboquant:k=int2,v=q8_0"]


def kernel_report(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_report.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)


def test_every_kernel_compiles_for_sm90_for_every_format():
    r = kernel_report("--compile-all", "--formats", ";".join(FORMATS), "--dtypes", "bfloat16", "--head-dims", "128")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": ok") == len(FORMATS), r.stdout


def test_float32_kernels_spill_to_a_few_kb_of_stack_at_most():
    """float32 queries take IEEE products on the CUDA cores with their operands in registers: the 128 x 128 tiles
    of 16-bit queries spilled 17-26 KB a thread there, which the driver reserves for every thread the GPU holds
    (an H100 ran out of memory at launch). `tuning.FLOAT32_TILE_N` keeps it small; the largest left is
    TurboQuant's dequantize from a dense recent window (its rotation, 5.7 KB)."""
    r = kernel_report("--compile-all", "--formats", "off;turboquant", "--dtypes", "float32", "--head-dims", "128",
                      "--stack-limit", "8192")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": ok, stack") == 2, r.stdout


def test_dense_decode_tiles_fit_four_programs_per_multiprocessor_without_spills(tmp_path):
    """`tuning.CTAS_PER_SM["dense"]` (4) assumes at most 128 registers per thread at 4 warps."""
    out = tmp_path / "report.json"
    r = kernel_report("--formats", "off", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())
    assert row["registers"] <= 128, row
    assert row["spill_bytes"] == 0, row


def test_a_new_batch_shape_does_not_compile_the_attention_kernels_again():
    """Batch size and block-table width change every step; Triton would otherwise compile a kernel per
    value class (== 1, multiple of 16, other), for seconds, mid-stream (`attention.PER_STEP_ARGS`)."""
    r = kernel_report("--count-variants", "--formats", "off")
    assert r.returncode == 0, r.stdout + r.stderr
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    # the split reduce: one variant for grids of fewer than `split_k.REDUCE_SMALL_GRID` (query token, head) pairs,
    # which share a head's channels between programs, one for larger ones
    assert counts == {"paged_attention_kernel": 1, "split_attention_kernel": 1, "reduce_splits_kernel": 2}, counts


def test_a_new_batch_shape_does_not_compile_the_warp_split_decode_kernel_again():
    """The same for the warp-split decode kernel (q4 pages: the transposed one): one variant unsplit, one split."""
    r = kernel_report("--count-variants", "--formats", "q4")
    assert r.returncode == 0, r.stdout + r.stderr
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts == {"paged_attention_kernel": 1, "split_attention_kernel": 1, "reduce_splits_kernel": 2,
                      "decode_kernel_transposed": 2}, counts


def test_the_warp_split_decode_kernel_compiles_in_both_orientations_for_every_format(tmp_path):
    """Each quantized format's default config (transposed), the original orientation and two lower register
    caps (a q6 tile whose loads returned tuples of two shapes once compiled only under the interpreter), and
    both orientations reading a dense recent window (`recent_tokens`) beside the pages."""
    out = tmp_path / "report.json"
    r = kernel_report("--warp-split", "--formats", "q8;q6;q4;turboquant", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert {(row["format"], row["transposed"]) for row in rows} == {
        (f, t) for f in ("q8", "q6", "q4", "turboquant") for t in (False, True)}
    assert all(row["loop_instructions"] > 0 and row["registers"] <= (row["max_registers"] or 255) for row in rows), rows
    assert {(row["format"], row["transposed"]) for row in rows if row["window"]} == {
        (f, t) for f in ("q8", "q6", "q4", "turboquant") for t in (False, True)}


def programs_per_sm(spec: str) -> int:
    """The resident programs a multiprocessor the Gluon decode's split count aims at for format `spec` (as
    `decode_gluon.launcher` gives it with the kernel)."""
    import torch

    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops.triton import decode_gluon

    fmt = make_format(KVFormat.parse(spec), 8, 128, torch.bfloat16, "cpu")
    query = torch.empty(4, 32, 128, dtype=torch.bfloat16)
    return decode_gluon.launcher(fmt, query, 16, kernels=decode_gluon.KERNELS)[1]


def resident_programs(registers: int) -> int:
    """One-warp programs a multiprocessor holds by their registers a lane: four partitions of 16,384 registers, one a
    scheduler, a warp's registers (in steps of 8 a lane) all in one (Nsight Compute's block limit: 16 at 104 and 128
    registers, 20 at 96)."""
    return 4 * (16384 // (-(-registers // 8) * 8 * 32))


def test_resident_programs_follow_the_register_partitions():
    assert [resident_programs(r) for r in (64, 80, 96, 104, 112, 128, 165, 200)] == [32, 24, 20, 16, 16, 16, 12, 8]


def test_the_gluon_decode_kernels_read_pages_into_registers_without_layout_conversions():
    """`decode_gluon.py` for sm_90 (q8: head_dim 64 and 128, split and not; TurboQuant, q4, q6, off; q8, TurboQuant
    and q4 with a dense recent window), both 16-bit query dtypes: its loop copies the page rows with cp.async
    (LDGSTS), reads them back (LDS), transposes P^T with MOVM, and stores nothing to shared memory itself (no
    layout conversion through it); no spills."""
    r = kernel_report("--gluon")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    tq44 = "turboquant:k=q4_0,v=q4_0"
    assert [row["format"] for row in rows] == (["q8"] * 8 + ["turboquant"] * 2 + [tq44] * 2 + ["q4"] * 2 + ["q6"] * 2
                                               + ["off"] * 4 + ["q8", "turboquant", "q4"]), r.stdout
    # `off` reads four KV heads a program by default (decode_gluon.DENSE_HEADS, a warp each), one in the last two;
    # its four splits across programs, or laid out by `dense_plan` where DENSE_INNER (compiled without a GPU: no
    # multiprocessor count, so four-warp programs)
    from pagedkv.ops.triton import decode_gluon

    served = decode_gluon.dense_plan(8, 4)[:2] if decode_gluon.DENSE_INNER else (decode_gluon.DENSE_HEADS, 1)
    assert [(row["kv_heads_per_program"], row["inner_splits"]) for row in rows if row["format"] == "off"] == [
        served, served, (1, 1), (1, 1)], r.stdout
    # with a dense recent window the pages' splits only end earlier: the same loop, but for a few instructions of
    # index arithmetic the compiler places differently (within 1% of the loop)
    loop = {(row["format"], row["head_dim"], row["dtype"], row["window"]): row["loop_ops"] for row in rows}
    work = ("HMMA", "MOVM", "LDGSTS", "LDS", "PRMT", "LOP3", "HADD2", "FMUL", "FFMA", "MUFU", "SHFL")
    for spec in ("q8", "turboquant", "q4"):
        with_window, without = loop[spec, 128, "torch.bfloat16", True], loop[spec, 128, "torch.bfloat16", False]
        assert {op: with_window.get(op) for op in work} == {op: without.get(op) for op in work}, spec
        assert abs(sum(with_window.values()) - sum(without.values())) <= 0.01 * sum(without.values()), spec
    # q4 and TurboQuant K q4_0 / V q4_0 read 32 keys a loop step by default (decode_gluon.Q4_PAIRS_BITS, TQ_PAIRS)
    assert {row["format"] for row in rows if row["keys_per_step"] == 32} == {"q4", tq44}, r.stdout
    for row in rows:
        ops = row["loop_ops"]
        steps = row["keys_per_step"] // 16   # 16-key steps a loop iteration holds
        mma_per_step = 2 * row["head_dim"] // 16   # S^T: head_dim / 16 k-steps; O^T: head_dim / 16 M-tiles
        assert row["spill_bytes"] == 0, row
        assert row["registers"] <= (128 if row["format"] in ("q8", "q4", "off") else 168), row
        # P^T transposed once, or once per value scale group (TurboQuant's values: four)
        assert ops.get("HMMA") == mma_per_step * steps, row
        assert ops.get("MOVM") == (8 if row["format"].startswith("turboquant") else 2) * steps, row
        # keys, values and scales each copied (at least three copies a step), never stored from registers
        assert ops.get("LDGSTS", 0) >= 3 * steps and "STS" not in ops, row
        # the copies wait for each other before any lane reads the ring: a barrier in the loop
        assert ops.get("BAR", 0) >= 1 and ops.get("DEPBAR", 0) >= 1, row
        # codes read back from the ring (LDS); dense rows through ldmatrix into the fragments, and so are TurboQuant's
        # 4-bit keys (a lane's 4 bytes of rows g and g + 8 from swizzled 16-byte units: ldmatrix's own pattern)
        ldsm = {"off": mma_per_step * steps, tq44: 4 * steps}.get(row["format"], 0)
        assert ops.get("LDSM", 0) == ldsm and "LDS" in ops, row
    from pagedkv.config import KVFormat
    from pagedkv.ops.triton import decode_gluon

    # the split counts aim at as many programs a multiprocessor as its registers hold (`resident_programs`;
    # one-warp programs): more would leave a tail of programs that start in a second wave; and the table the split
    # rule reads them from (`decode_gluon.RESIDENT_PROGRAMS`) holds what the compiled kernels' registers give
    for row in rows:
        if row["format"] != "off":   # four-warp programs, sized by their own rule (`dense_heads`)
            assert programs_per_sm(row["format"]) <= resident_programs(row["registers"]), row
            if row["head_dim"] == 128:
                table = decode_gluon.resident_programs(KVFormat.parse(row["format"]), 128)
                assert table == resident_programs(row["registers"]), row


def test_page_offsets_in_32_bits_shorten_every_gluon_decode_loop_without_spills():
    """`decode_gluon.offsets_in_32_bits`: a block's offset as an int32 product (pages of fewer than 2^31 elements)
    takes fewer instructions a loop step than the int64 one in every Gluon decode kernel (`off`'s with its splits
    across programs, as timed), with no spills and no fewer programs a multiprocessor by their registers
    (`resident_programs`)."""
    r = kernel_report("--gluon-offsets")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(row["format"], row["offsets32"]) for row in rows] == [
        (spec, o) for spec in ("q8", "q4", "q6", "turboquant", "turboquant:k=q4_0,v=q4_0", "off") for o in (False, True)]
    for wide, narrow in zip(rows[::2], rows[1::2]):
        assert narrow["spill_bytes"] == 0, narrow
        assert resident_programs(narrow["registers"]) >= resident_programs(wide["registers"]), (wide, narrow)
        assert sum(narrow["loop_ops"].values()) < sum(wide["loop_ops"].values()), (wide, narrow)
        assert narrow["loop_ops"].get("HMMA") == wide["loop_ops"].get("HMMA"), (wide, narrow)


def test_decodes_with_block_ids_a_step_ahead_compile_to_the_same_copies_without_spills():
    """`ids_ahead` (`decode_gluon.DENSE_IDS_AHEAD` for `off`): the dense and TurboQuant Gluon decodes that load the
    next step's block id during a step still load one block id a loop step and issue the same copies and matrix
    products, spill nothing and fit no fewer programs a multiprocessor by their registers (`resident_programs`)."""
    r = kernel_report("--gluon-ids-ahead")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(row["format"], row["head_dim"], row["ids_ahead"]) for row in rows] == [
        (spec, d, ahead) for spec, d in (("off", 64), ("off", 128), ("turboquant", 128),
                                         ("turboquant:k=q4_0,v=q4_0", 128)) for ahead in (False, True)]
    for served, ahead in zip(rows[::2], rows[1::2]):
        assert ahead["spill_bytes"] == 0, ahead
        assert resident_programs(ahead["registers"]) >= resident_programs(served["registers"]), (served, ahead)
        for op in ("LDG", "LDGSTS", "HMMA", "LDSM"):
            assert ahead["loop_ops"].get(op) == served["loop_ops"].get(op), (op, served, ahead)
        assert served["loop_ops"]["LDG"] == 1, served


def test_the_dense_decode_with_splits_inside_a_program_keeps_the_loop_without_spills():
    """`paged_attention_dense(inner=4, heads=2)` (`decode_dense_kernel` with INNER): each warp's loop issues the served
    kernel's copies, block-id load and matrix products a step and spills nothing; at head_dim 128 (the one timed) it
    fits no fewer programs by its registers (at 64 its merge takes 94-96 registers against 80); its eight warps'
    rings take twice the shared memory of the served four."""
    r = kernel_report("--gluon-inner")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(row["head_dim"], row["inner"], row["num_splits"]) for row in rows] == [
        (d, inner, splits) for d in (64, 128) for inner, splits in ((1, 4), (4, 1), (4, 4))]
    for served, one, split in zip(rows[::3], rows[1::3], rows[2::3]):
        for inner in (one, split):
            assert inner["spill_bytes"] == 0, inner
            if served["head_dim"] == 128:
                assert resident_programs(inner["registers"]) >= resident_programs(served["registers"]), (served, inner)
            for op in ("LDG", "LDGSTS", "HMMA", "LDSM"):
                assert inner["loop_ops"].get(op) == served["loop_ops"].get(op), (op, served, inner)
            assert inner["shared_bytes"] == 2 * served["shared_bytes"], (served, inner)


def test_the_probes_split_a_turboquant_step_into_its_copies_and_its_work():
    """`paged_attention_tq`'s probes (`bench/gluon_probe.py`): with probe="copies" the loop issues the same copies and
    waits as the kernel, and none of its matrix products, look-ups or softmax; with probe="work" the same matrix
    products, look-ups and softmax, and no copies or waits."""
    r = kernel_report("--gluon-copies")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(row["format"], row["probe"]) for row in rows] == [
        (spec, p) for spec in ("turboquant", "turboquant:k=q4_0,v=q4_0") for p in ("kernel", "copies", "work")]
    copying, working = ("LDGSTS", "LDGDEPBAR", "DEPBAR"), ("HMMA", "PRMT", "MUFU", "SHFL")
    for kernel, copies, work in zip(rows[::3], rows[1::3], rows[2::3]):
        assert kernel["loop_ops"]["HMMA"] == 16 and all(kernel["loop_ops"].get(op) for op in copying + working), kernel
        for op in copying:
            assert copies["loop_ops"].get(op) == kernel["loop_ops"][op] and op not in work["loop_ops"], (op, work)
        for op in working:
            assert work["loop_ops"].get(op) == kernel["loop_ops"][op] and op not in copies["loop_ops"], (op, copies)
        assert sum(copies["loop_ops"].values()) < 0.2 * sum(kernel["loop_ops"].values()), (kernel, copies)
        assert copies["spill_bytes"] == work["spill_bytes"] == 0, (copies, work)


def test_turboquant_decode_variants_with_half_register_scales_and_codebook_tables_compile_leaner():
    """(And q4's with its keys over their offsets: below.) TurboQuant's decode with its scale columns widened from
    half registers (`halves`, served since it was timed) runs fewer shifts and fewer loop instructions than with
    them shifted out of their words, the same matrix products, without spills; with the 3-bit codebook's tables held
    in registers (`tables`), capped at 128 as served or uncapped, the moves of those tables into a register before
    each look-up are gone (uncapped in few enough registers for 12 one-warp programs a multiprocessor: 152 or
    fewer)."""
    r = kernel_report("--gluon-lean")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [row["format"] for row in rows] == (["turboquant"] * 4 + ["turboquant:k=q4_0,v=q4_0"] * 2 + ["q4"] * 2
                                               + ["turboquant"] * 2 + ["q4"])
    for shifted, halves in ((rows[0], rows[1]), (rows[4], rows[5])):
        assert halves["loop_ops"]["SHF"] < shifted["loop_ops"]["SHF"], (shifted, halves)
        assert sum(halves["loop_ops"].values()) < sum(shifted["loop_ops"].values()), (shifted, halves)
        assert halves["loop_ops"]["HMMA"] == shifted["loop_ops"]["HMMA"], (shifted, halves)
    assert all(row["spill_bytes"] == 0 for row in rows), rows
    # the tables lane-varying to the assembler (`code_tables`): no moves at the served cap of 128 either
    for tables in rows[2:4]:
        assert sum(tables["loop_ops"].values()) < sum(rows[1]["loop_ops"].values()) - 20, (rows[1], tables)
    assert rows[2]["registers"] <= 128 and rows[3]["registers"] <= 152, rows[2:4]
    # q4 keys left over their offsets: no float16 subtraction or multiply-add per code pair, 16 programs still fit
    q4, offset = rows[6], rows[7]
    assert sum(offset["loop_ops"].values()) < sum(q4["loop_ops"].values()) - 40, (q4, offset)
    fp16_ops = lambda row: row["loop_ops"].get("HADD2", 0) + row["loop_ops"].get("HFMA2", 0)  # noqa: E731
    assert fp16_ops(offset) < fp16_ops(q4) and offset["loop_ops"]["HMMA"] == q4["loop_ops"]["HMMA"], (q4, offset)
    assert offset["registers"] <= 128, offset
    # K q8_0 / V q3_0 with the pages' slot strides as constants (`rows`: one address a lane's copies), then with the
    # tables, 32-bit page offsets and the softmax sums left in the lanes (no shuffles for them) too: fewer
    # instructions than served, at the served cap of 128
    rows_only, leanest = rows[8], rows[9]
    assert sum(rows_only["loop_ops"].values()) < sum(rows[1]["loop_ops"].values()), (rows[1], rows_only)
    assert sum(leanest["loop_ops"].values()) < sum(rows[2]["loop_ops"].values()) - 15, (rows[2], leanest)
    assert leanest["registers"] <= 128 and leanest["loop_ops"]["HMMA"] == rows[1]["loop_ops"]["HMMA"], leanest
    assert leanest["loop_ops"]["SHFL"] < rows[1]["loop_ops"]["SHFL"], (rows[1], leanest)
    # q4 with its keys over their offsets, the sums in the lanes and 32-bit page offsets: 16 programs still fit
    q4_leanest = rows[10]
    assert sum(q4_leanest["loop_ops"].values()) < sum(offset["loop_ops"].values()) - 20, (offset, q4_leanest)
    assert q4_leanest["registers"] <= 128 and q4_leanest["loop_ops"]["SHFL"] < q4["loop_ops"]["SHFL"], q4_leanest


def test_the_skewed_turboquant_and_q4_decodes_keep_their_products_and_programs_with_a_deeper_ring():
    """TQ_SKEW (`decode_gluon.tq_skewed_loop`: a step's scores and softmax beside the value products of the step
    before) and Q4_SKEW (`q4_skewed_pairs`, 32-key steps): the same matrix products, look-ups and shuffles a step as
    served, at 128 registers (q4 capped there when skewed), without spills, so 16 one-warp programs still fit a
    multiprocessor by registers and by shared memory (the ring a half again of the served one; TurboQuant with three
    stages twice); TurboQuant's work-only probe as much work as the served one's."""
    r = kernel_report("--gluon-skew")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [row["options"] for row in rows] == [
        {}, {"skew": True}, {"skew": True, "stages": 3},
        {"skew": True, "rows": True, "tables": True, "offsets32": True}, {"probe": "work"},
        {"probe": "work", "skew": True}, {}, {"skew": True}]
    assert [row["format"] for row in rows] == ["turboquant"] * 6 + ["q4"] * 2
    served, skewed, skewed3, leanest, work, work_skewed, q4, q4_skewed = rows
    for base, row in ((served, skewed), (served, skewed3), (served, leanest), (q4, q4_skewed)):
        for op in ("HMMA", "PRMT", "MUFU", "SHFL", "LDGSTS"):
            assert row["loop_ops"].get(op) == base["loop_ops"].get(op), (op, base, row)
        assert row["registers"] <= 128 and row["spill_bytes"] == 0, row
        assert resident_programs(row["registers"]) == 16 and 16 * row["shared_bytes"] <= 227 * 1024, row
    assert q4_skewed["shared_bytes"] == 3 * q4["shared_bytes"] // 2, (q4, q4_skewed)
    assert sum(q4_skewed["loop_ops"].values()) < 1.1 * sum(q4["loop_ops"].values()), (q4, q4_skewed)
    assert skewed["shared_bytes"] == 3 * served["shared_bytes"] // 2, (served, skewed)
    assert skewed3["shared_bytes"] == 2 * served["shared_bytes"], (served, skewed3)
    assert sum(skewed["loop_ops"].values()) < 1.1 * sum(served["loop_ops"].values()), (served, skewed)
    assert sum(leanest["loop_ops"].values()) < sum(served["loop_ops"].values()), (served, leanest)
    assert "LDGSTS" not in work_skewed["loop_ops"] and work_skewed["spill_bytes"] == 0, work_skewed
    for op in ("HMMA", "PRMT", "MUFU", "SHFL"):
        assert work_skewed["loop_ops"].get(op) == work["loop_ops"][op], (op, work, work_skewed)


def test_the_gluon_prefill_kernel_compiles_to_wgmma_and_tma_without_spills():
    """`prefill_gluon.py` for sm_90 (head_dim 64 and 128, both 16-bit dtypes, blocks of 16 and 64): both products on
    `wgmma` (HGMMA, never the older HMMA), page blocks copied by TMA (UTMALDG, no per-lane cp.async), the query rows
    and two key and value tiles within a multiprocessor's shared memory, no spills, and the partitions of the
    warp-specialized kernel resizing their registers (setmaxnreg: USETMAXREG)."""
    r = kernel_report("--gluon-prefill")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(row["head_dim"], row["block_size"]) for row in rows] == [(64, 16), (64, 16), (128, 16), (128, 16), (128, 64)]
    for row in rows:
        ops = row["ops"]
        assert row["spill_bytes"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row
        assert ops.get("HGMMA", 0) > 0 and "HMMA" not in ops, row
        assert ops.get("UTMALDG", 0) > 0 and "LDGSTS" not in ops, row
        assert "USETMAXREG" in ops, row


def test_a_split_decode_launches_its_window_and_reduce_kernels_as_dependents():
    """Programmatic dependent launch (`split_k.dependent_launch`, on sm_90+): the page kernel lets the next kernel
    start, the window's and the reduce kernels are launched as dependents and wait for the kernel before them (the
    window's kernel after its own stores: the reduce after it must see the pages' splits too)."""
    r = kernel_report("--dependent-launch")
    assert r.returncode == 0, r.stdout + r.stderr
    found = json.loads(r.stdout.strip().splitlines()[-1])
    tq = "turboquant:k=q4_0,v=q4_0/"
    for name in (tq + "decode_tq_kernel", "off/decode_dense_kernel", "off-plan/decode_dense_kernel"):
        assert found[name]["lines"] == ["griddepcontrol.launch_dependents"] and not found[name]["launch_pdl"], found
        assert not found[name]["after_stores"], found[name]   # at the start
    assert found[tq + "ring_partial_kernel"] == {"lines": ["griddepcontrol.wait"], "launch_pdl": True,
                                                 "after_stores": True}
    for name in (tq + "reduce_splits_kernel", "off/reduce_splits_kernel", "off-plan/reduce_splits_kernel"):
        assert found[name] == {"lines": ["griddepcontrol.wait"], "launch_pdl": True, "after_stores": False}, found
