"""The TurboQuant write compiled for an H100/H200 (sm_90): its sums add in the order the search relies on, and
nothing spills.

The value-scale search picks the first least squared error among 33 candidate scales, so its sums must be
added in one fixed order (`codecs.halving_sum`, `codecs.candidate_errors`): compiled, `tl.sum` adds in the order
of the layout it is given, a butterfly across lanes when every lane holds one element of the summed axis. This
compiles `write_kv_kernel` through its real launcher (`bench/kernel_report.py`'s compile-only target, in a
subprocess: this test session has chosen the interpreter) and reads the layouts of its float32 sums from the IR.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [("turboquant", 64), ("turboquant", 128), ("turboquant", 256), ("turboquant:k=q4_0,v=q4_0", 64),
         ("turboquant:k=q4_0,v=q4_0", 128), ("turboquant:k=q5_0,v=q2_0", 128), ("turboquant:k=int2,v=q8_0", 128),
         ("turboquant:k=q8_0,v=q5_0", 64)]
CAPPED = [("turboquant", 128, 72), ("turboquant", 64, 64)]   # kv_write.TQ_MAX_REGISTERS (prefill-sized writes)


def float_sums(ttgir: str) -> list[dict]:
    """Each float32 add-reduction of the IR: its axis, shape and layout (parsed when blocked)."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    sums = []
    # (a body never spans into the next reduction: one over integers ends in a type this pattern does not match)
    for m in re.finditer(r'"tt\.reduce"\(%[\w#]+\) <\{axis = (\d+) : i32\}> \(\{((?:(?!"tt\.reduce").)*?)\}\) : '
                         r'\(tensor<([0-9x]+)xf32, (#\w+)>\)', ttgir, re.S):
        if "arith.addf" not in m.group(2):
            continue
        layout = layouts.get(m.group(4), m.group(4))
        fields = {k: [int(v) for v in vals.split(",")]
                  for k, vals in re.findall(r"(\w+) = \[([\d, ]+)\]", layout)} if "blocked" in layout else {}
        sums.append({"axis": int(m.group(1)), "shape": [int(v) for v in m.group(3).split("x")], "layout": layout,
                     **fields})
    return sums


def compile_report() -> list[dict]:
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    import kernel_report as kr
    import torch
    from triton.runtime import driver

    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format
    from pagedkv.ops.metadata import AttentionMetadata
    from pagedkv.ops.triton import kv_write

    driver.set_active(kr._Sm90Target())
    rows = []
    kv_write.TQ_CAP_TOKENS = 1
    for spec, head_dim, cap in [(*case, None) for case in CASES] + CAPPED:
        kv_write.TQ_MAX_REGISTERS = cap
        fmt = make_format(KVFormat.parse(spec), 2, head_dim, torch.bfloat16, "cpu")
        meta = AttentionMetadata(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                 torch.zeros(2, dtype=torch.int32), torch.arange(3), None, [0], [0, 0], 16)
        kv = torch.empty(3, 2, head_dim, dtype=torch.bfloat16)
        with kr._CompileOnly() as launches:
            kv_write.write_kv(fmt.allocate_pages(4, 16), fmt, kv, kv, meta)
        kernel = launches.compiled[0]
        info, _ = kr.assemble(kernel)
        rows.append({"format": spec, "head_dim": head_dim, "cap": cap, **kr.ptxas_usage(info),
                     "sums": float_sums(kernel.asm["ttgir"])})
    return rows


def test_the_value_search_sums_in_its_order_and_nothing_spills():
    """Every case's sums add in the search's order and nothing spills; under a register cap
    (`kv_write.TQ_MAX_REGISTERS`) the kernel holds at most that many registers, its sums in the same order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == len(CASES) + len(CAPPED)
    for row in rows:
        if row["cap"] is None:
            assert row["spill_bytes"] == 0, row
        else:   # a register cap may spill a little (to L1); the sums below keep their order all the same
            assert row["registers"] <= row["cap"] and row["stack_bytes"] <= 256, row
        groups = row["head_dim"] // 32
        sums = row["sums"]
        one_by_one = row["format"].endswith(("q5_0", "q8_0"))   # 5- and 8-bit values: `search_scales_one_by_one`
        # the group RMS (16 pairs of squares; one by one, spelled out as sums of two) and the error sums (32 / groups
        # elements after the pieces; one by one, all 32 of a group)
        assert {s["shape"][s["axis"]] for s in sums} == ({2, 32} if one_by_one else {16, 32 // groups}), (row, sums)
        for s in sums:
            axis, n = s["axis"], s["shape"][s["axis"]]
            if n == 2:
                continue                                        # one addition: the same in any layout
            assert axis == len(s["shape"]) - 1 and "sizePerThread" in s, s
            if n == 32:   # one candidate at a time sums as it always did: in-thread e, e + L, ..., then L lanes
                assert s["sizePerThread"] == [1, 1, 1] and s["threadsPerWarp"] == [1, groups, 32 // groups] \
                    and s["order"] == [0, 1, 2], (row["format"], row["head_dim"], s)
            else:         # `halving_sum` by `tl.sum`: across lanes only
                assert s["sizePerThread"][axis] == 1 and s["threadsPerWarp"][axis] == n and s["order"][0] == axis, \
                    (row["format"], row["head_dim"], s)

if __name__ == "__main__":
    print(json.dumps(compile_report()))
