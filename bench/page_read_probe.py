"""How fast a GPU reads a decode batch's keys and values when nothing is computed: the bound a dense (`off`) decode
kernel can reach, over pages (blocks of 16 slots, shuffled or in order, as `bench/kernel_bench.py` lays them out)
and over the contiguous [batch, KV heads, context, head_dim] cache SDPA reads; beside SDPA's own decode time.

    python bench/page_read_probe.py --out bench/results/h200
    python bench/page_read_probe.py --heads 4 --warps 4 --stages 2   # four KV heads a program, as the dense decode

The read kernel sums every key and value a (sequence, KV head, split) program would attend, in steps of one block
(TILE rows of head_dim), with Triton's pipelined loads, and stores one float per program. If pages read in order
or shuffled stream as fast as the contiguous cache, the decode kernel's gap to SDPA is the kernel's; if not, the
layout's. Writes page_read_probe.json and a plot. `check_layouts` (tests/triton/test_page_read_probe.py, on
the CPU under the interpreter) checks that every layout reads the same keys and values.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py)

SHAPES = [(1, 32768), (32, 4096), (64, 8192), (128, 2048)]


@triton.jit
def read_kernel(out_ptr, k_ptr, v_ptr, table_ptr, stride_t, stride_block, stride_head, stride_row,
                BLOCKS: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, STAGES: tl.constexpr,
                HEADS: tl.constexpr = 1):
    """Program (sequence, group of HEADS KV heads, split): the sum of its BLOCKS blocks' keys and values. Block b of
    the sequence starts at table[seq, b] * stride_block + head * stride_head elements, its TILE rows stride_row
    apart; a step reads the group's heads of one block together (as the dense decode's four heads a program)."""
    seq = tl.program_id(0)
    head = tl.program_id(1) * HEADS
    split = tl.program_id(2)
    i = tl.arange(0, HEADS * TILE)
    rows = ((i // TILE) * stride_head + (i % TILE) * stride_row)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    acc = tl.zeros([HEADS * TILE, HEAD_DIM], dtype=tl.float32)
    first = split * BLOCKS
    for i in tl.range(first, first + BLOCKS, num_stages=STAGES):
        block = tl.load(table_ptr + seq.to(tl.int64) * stride_t + i).to(tl.int64)
        at = block * stride_block + head * stride_head + rows
        acc += tl.load(k_ptr + at).to(tl.float32) + tl.load(v_ptr + at).to(tl.float32)
    tl.store(out_ptr + (seq * tl.num_programs(1) + head) * tl.num_programs(2) + split, tl.sum(tl.sum(acc, 1), 0))


def read(layout, splits: int, stages: int, warps: int, group: int = 1) -> torch.Tensor:
    """The sums of one `layouts` entry (k, v, table, (stride_block, stride_head, stride_row), heads, tile,
    head_dim) over `splits` splits per (sequence, group of `group` heads): [seqs * heads / group * splits]."""
    k, v, table, strides, heads, tile, head_dim = layout
    seqs, per_seq = table.shape
    assert per_seq % splits == 0, "blocks per sequence must divide into the splits"
    assert heads % group == 0, "the head groups must divide the heads"
    out = torch.empty(seqs * heads // group * splits, dtype=torch.float32, device=k.device)
    read_kernel[(seqs, heads // group, splits)](
        out, k, v, table, table.stride(0), *strides, BLOCKS=per_seq // splits, TILE=tile, HEAD_DIM=head_dim,
        STAGES=stages, HEADS=group, num_warps=warps)
    return out


def layouts(num_seqs: int, seq_len: int, heads: int, head_dim: int, tile: int, device, gen):
    """name -> a layout for `read`: pages [blocks, heads, tile, head_dim] (head-major, as the cache stores them)
    on shuffled blocks or in order, and the contiguous [seqs, heads, seq_len, head_dim] cache SDPA reads, all
    holding the same random keys and values."""
    per_seq = seq_len // tile
    blocks = num_seqs * per_seq
    k = torch.randn(blocks, heads, tile, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ordered = torch.arange(blocks, device=device, dtype=torch.int32).view(num_seqs, per_seq)
    shuffled = torch.randperm(blocks, generator=gen).to(device, torch.int32).view(num_seqs, per_seq)
    page_strides = (heads * tile * head_dim, tile * head_dim, head_dim)
    # the contiguous cache: block b of sequence s and head h at ((s * heads + h) * per_seq + b) * tile rows
    kc = k.view(num_seqs, per_seq, heads, tile, head_dim).transpose(1, 2).contiguous()
    vc = v.view(num_seqs, per_seq, heads, tile, head_dim).transpose(1, 2).contiguous()
    starts = (torch.arange(num_seqs, device=device)[:, None] * heads * per_seq
              + torch.arange(per_seq, device=device)[None, :]).to(torch.int32)
    contiguous_strides = (tile * head_dim, per_seq * tile * head_dim, head_dim)
    shape = (heads, tile, head_dim)
    return {"pages shuffled": (k, v, shuffled, page_strides, *shape),
            "pages in order": (k, v, ordered, page_strides, *shape),
            "contiguous": (kc, vc, starts, contiguous_strides, *shape)}


def probe(shapes, splits_by_batch: dict, tile: int, stages: int, warps: int, gen, group: int = 1) -> list[dict]:
    import kernel_bench as kb

    rows = []
    for num_seqs, seq_len in shapes:
        per_seq = seq_len // tile
        splits = splits_by_batch.get(num_seqs, max(1, min(per_seq, 8 * 132 // (num_seqs * kb.NUM_KV_HEADS))))
        while per_seq % splits:
            splits -= 1
        copies = kb.copies_for(num_seqs * seq_len * kb.NUM_KV_HEADS * kb.HEAD_DIM * 4)
        sets = [layouts(num_seqs, seq_len, kb.NUM_KV_HEADS, kb.HEAD_DIM, tile, kb.DEV, gen) for _ in range(copies)]
        nbytes = 2 * num_seqs * seq_len * kb.NUM_KV_HEADS * kb.HEAD_DIM * 2
        row = {"batch": num_seqs, "context": seq_len, "splits": splits, "heads_a_program": group, "bytes": nbytes}
        for name in sets[0]:
            ms = kb.time_per_call([lambda s=s: read(s[name], splits, stages, warps, group) for s in sets])
            row[name] = {"us": ms * 1e3, "gbps": nbytes / ms / 1e6}
        keys = torch.randn(num_seqs * seq_len, kb.NUM_KV_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
        queries = [torch.randn(num_seqs, kb.NUM_Q_HEADS, kb.HEAD_DIM, device=kb.DEV, dtype=torch.bfloat16)
                   for _ in range(copies)]
        sdpa_ms = kb.sdpa_decode(keys, torch.randn_like(keys), num_seqs, seq_len, queries, copies)[0]
        row["sdpa decode"] = {"us": sdpa_ms * 1e3, "gbps": nbytes / sdpa_ms / 1e6}
        rows.append(row)
        print(f"({num_seqs}, {seq_len}), {splits} splits: " + ", ".join(
            f"{name} {row[name]['us']:.1f} us ({row[name]['gbps']:.0f} GB/s)"
            for name in ("pages shuffled", "pages in order", "contiguous", "sdpa decode")), flush=True)
        del sets, keys, queries
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None or not rows:
        return
    names = ("pages shuffled", "pages in order", "contiguous", "sdpa decode")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plotting.grouped_bars(ax, [f"B={r['batch']}\nS={r['context']}" for r in rows],
                          {n: [r[n]["gbps"] for r in rows] for n in names})
    ax.set_ylabel("GB/s (keys and values read / time)")
    ax.set_title("reading a decode batch's keys and values: pages, contiguous cache, SDPA decode")
    ax.legend(fontsize=8)
    plotting.save(fig, path)


def check_layouts(device) -> list[str]:
    """Each layout's sums (2 sequences of 64 tokens, 2 heads of 16 channels, 2 splits) match a direct sum of the
    same keys and values; returns the layouts checked."""
    gen = torch.Generator().manual_seed(0)
    cases = layouts(2, 64, 2, 16, 16, device, gen)
    found = {name: read(layout, 2, 1, 1).view(2, 2, 2) for name, layout in cases.items()}
    together = read(cases["pages shuffled"], 2, 1, 1, group=2).view(2, 2)   # both heads a program: their sum
    assert torch.allclose(together, found["pages shuffled"].sum(1), rtol=1e-4, atol=1e-3), together
    k, v = cases["pages in order"][:2]
    for name, table in (("pages shuffled", cases["pages shuffled"][2]), ("pages in order", cases["pages in order"][2]),
                        ("contiguous", cases["pages in order"][2])):    # the contiguous cache holds the in-order pages
        blocks = table.long().view(2, 2, -1)                                          # [seq, split, blocks]
        want = (k.float() + v.float())[blocks].sum(dim=(2, 4, 5)).permute(0, 2, 1)   # [seq, head, split]
        assert torch.allclose(found[name], want, rtol=1e-4, atol=1e-3), (name, found[name], want)
    return list(found)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES), help="batch x context, ','-separated")
    p.add_argument("--splits", default='{"1": 128, "32": 4, "64": 2, "128": 1}',
                   help="JSON: batch -> splits (the dense decode's at these shapes); others fill 8 programs per SM")
    p.add_argument("--tile", type=int, default=16, help="rows a step: the block size")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--warps", type=int, default=1)
    p.add_argument("--heads", type=int, default=1, help="KV heads a program reads together (the dense decode: 4)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    splits = {int(b): n for b, n in json.loads(args.splits).items()}
    rows = probe(shapes, splits, args.tile, args.stages, args.warps, torch.Generator().manual_seed(0), args.heads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "page_read_probe.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "page_read_probe.png")


if __name__ == "__main__":
    main()
