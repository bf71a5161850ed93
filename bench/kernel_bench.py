"""GPU benchmark of pagedkv's Triton kernels against SDPA over a contiguous bf16 cache, measured in one run.

    python bench/kernel_bench.py [--out bench/results/kernels] [--formats "off;q8;..."] [--sweep] [--quick]

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16 queries, block_size 16,
shuffled block tables. Every timing is the median over replays of a CUDA graph that runs the op on
several copies of its data ("layers", together at least 3x the L2 cache) so each call reads from
device memory, as in a model's forward; the time reported is per call.
  - copy: the GPU's device-to-device copy bandwidth (bytes read + written), the roofline;
  - decode: one query token per sequence at (batch, context) for every format; effective bandwidth =
    page bytes read / time; ratio = SDPA time / ours (>1: faster), SDPA being the faster of
    `enable_gqa=True` and the query heads of a group packed as queries;
  - prefill: a 2,048-token chunk after 0 and 8,192 tokens of context vs SDPA causal (lower-right);
  - write: `write_kv` of 64 decode tokens and of a 2,048-token chunk, per format.
Writes OUT.json, OUT.png and prints the tables; `--sweep` also times tile shapes for the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)
from pagedkv.config import KVFormat  # noqa: E402
from pagedkv.formats import make_format  # noqa: E402
from pagedkv.ops import reference  # noqa: E402
from pagedkv.ops import triton as triton_ops  # noqa: E402
from pagedkv.ops import metadata  # noqa: E402
from pagedkv.ops.metadata import AttentionMetadata  # noqa: E402
from pagedkv.ops.triton import attention, split_k, tuning  # noqa: E402
from pagedkv.ops.triton.tuning import DecodeTiles, TileConfig  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SLOT_MAJOR = "--slot-major" in sys.argv
DECODE_SHAPES = [(1, 32768), (32, 4096), (64, 8192), (128, 2048)]
PREFILL_CHUNK, PREFILL_CONTEXTS = 2048, [0, 8192]
FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0", "turboquant:k=q8_0,v=q4_0",
           "turboquant:k=q4_0,v=q2_0"]
SWEEP_FORMATS = ("off", "q8", "q4", "turboquant")   # swept at every decode shape
DEV = torch.device("cuda")
SCALE = HEAD_DIM ** -0.5


# ------------------------------------------------------------------------------------------------
# timing
def time_per_call(calls, *, replays=15, min_ms=20.0) -> float:
    """Median ms per call of `calls` (one callable per data copy) run round-robin inside a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    end.synchronize()
    one_round = max(start.elapsed_time(end), 1e-3)
    rounds = max(1, min(200, math.ceil(min_ms / one_round)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for c in calls:
                c()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def copies_for(bytes_per_copy: int) -> int:
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    return max(2, min(8, math.ceil(3 * l2 / max(bytes_per_copy, 1))))


def warm_up(seconds: float = 2.0) -> None:
    """Bring the clocks up before the first measurement (an idle GPU starts at a few hundred MHz)."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth() -> dict:
    """Device-to-device copy of 1 GiB buffers, bytes read + written: the faster of a copy kernel timed in a
    graph (`torch.mul(src, 1, out=dst)`) and `copy_` timed eagerly with events (a memcpy node in a graph
    may run on the copy engines, which are slower)."""
    n = 1 << 28
    src = [torch.randn(n, device=DEV) for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    kernel_ms = time_per_call([lambda s=s, d=d: torch.mul(s, 1.0, out=d) for s, d in zip(src, dst)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(20):
        start.record()
        dst[i % 2].copy_(src[i % 2])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    memcpy_ms = statistics.median(times[2:])
    del src, dst
    ms = min(kernel_ms, memcpy_ms)
    return {"bytes": 2 * 4 * n, "ms": ms, "gbps": 2 * 4 * n / ms / 1e6,
            "kernel_gbps": 2 * 4 * n / kernel_ms / 1e6, "memcpy_gbps": 2 * 4 * n / memcpy_ms / 1e6}


# ------------------------------------------------------------------------------------------------
# data
def paged_layer(fmt_spec: str, keys: torch.Tensor, values: torch.Tensor, num_seqs: int, seq_len: int, gen):
    """Pages of one layer holding `keys`/`values` [num_seqs * seq_len, H, D] on blocks shuffled by `gen` (in order
    when None)."""
    blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    fmt = make_format(KVFormat.parse(fmt_spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, DEV)
    if SLOT_MAJOR:  # the layout before head-major pages: a block's slots one after another, all heads in each
        pages = {name: torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, width, dtype=dt, device=DEV)
                 for name, (width, dt) in fmt.page_spec().items()}
    else:
        pages = fmt.allocate_pages(num_blocks, BLOCK_SIZE)
    perm = (torch.arange(num_blocks) if gen is None else torch.randperm(num_blocks, generator=gen)).to(DEV, torch.int32)
    table = perm.view(num_seqs, blocks_per_seq)
    pos = torch.arange(seq_len, device=DEV)
    slots = (table[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    lens = [seq_len] * num_seqs
    qsl = list(range(0, num_seqs * seq_len + 1, seq_len))
    write = AttentionMetadata(table, torch.tensor(lens, dtype=torch.int32, device=DEV),
                              torch.tensor(qsl, dtype=torch.int32, device=DEV), slots, None, lens, qsl, BLOCK_SIZE)
    triton_ops.write_kv(pages, fmt, keys, values, write)
    return fmt, pages, table


def decode_meta(table: torch.Tensor, seq_len: int | list[int], num_new: int = 1) -> AttentionMetadata:
    """Metadata of a step of `num_new` tokens per sequence over `table`; `seq_len`: every sequence's length, or a
    list of one length per sequence (each within the table's reach). With the token order the engine's steps get
    (`metadata.launch_order`: longest first while `metadata.LONGEST_FIRST`), so the kernels launch as served."""
    n = table.shape[0]
    lens = list(seq_len) if isinstance(seq_len, (list, tuple)) else [seq_len] * n
    qsl = list(range(0, n * num_new + 1, num_new))
    return AttentionMetadata(table, torch.tensor(lens, dtype=torch.int32, device=DEV),
                             torch.tensor(qsl, dtype=torch.int32, device=DEV),
                             torch.zeros(n * num_new, dtype=torch.int64, device=DEV), None, lens, qsl, BLOCK_SIZE,
                             token_order=metadata.launch_order(lens, [num_new] * n, DEV))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------------------------------------
# decode
def sdpa_decode(keys, values, num_seqs, seq_len, queries, copies):
    """Faster of two SDPA formulations over contiguous [B, Hkv, S, D] caches; returns (ms, which, outputs)."""
    caches = []
    for _ in range(copies):
        k = keys.view(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        v = values.view(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        caches.append((k, v))
    group = NUM_Q_HEADS // NUM_KV_HEADS

    def gqa(q, k, v):  # q [B, Hq, 1, D]
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)

    def packed(q, k, v):  # the group's heads as queries of one KV head: q [B, Hkv, group, D]
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE)

    q4 = [q.view(num_seqs, NUM_Q_HEADS, 1, HEAD_DIM) for q in queries]
    qp = [q.view(num_seqs, NUM_KV_HEADS, group, HEAD_DIM) for q in queries]
    results = {}
    for name, fn, qs in [("enable_gqa", gqa, q4), ("heads_as_queries", packed, qp)]:
        try:
            ms = time_per_call([lambda fn=fn, q=q, c=c: fn(q, *c) for q, c in zip(qs, caches)])
            results[name] = ms
        except RuntimeError as e:  # a formulation this torch build cannot run
            results[name] = None
            print(f"  sdpa {name}: {e}", file=sys.stderr)
    ref_out = gqa(q4[0], *caches[0]).view(num_seqs, NUM_Q_HEADS, HEAD_DIM)
    best = min((v, k) for k, v in results.items() if v is not None)
    del caches
    return best[0], best[1], results, ref_out


def window_for(table: torch.Tensor, seq_len: int, recent_tokens: int, meta: AttentionMetadata, keys, values):
    """`meta` with a dense recent window of `recent_tokens` (`pagedkv.window`): each sequence's ring holds its
    last blocks exact (rows in order), read by the decode kernel beside the older blocks' pages."""
    import dataclasses

    from pagedkv.ops.metadata import WindowPlan

    num_seqs = table.shape[0]
    ring_blocks = recent_tokens // BLOCK_SIZE + 1
    first = max(0, (seq_len - recent_tokens) // BLOCK_SIZE)
    shape = (num_seqs, ring_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    rings = (torch.zeros(shape, dtype=torch.bfloat16, device=DEV), torch.zeros(shape, dtype=torch.bfloat16, device=DEV))
    kv = (keys.view(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM), values.view(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM))
    for pos in range(first * BLOCK_SIZE, seq_len, BLOCK_SIZE):  # block by block, as the cache fills them
        b = pos // BLOCK_SIZE
        end = min(pos + BLOCK_SIZE, seq_len)
        for ring, src in zip(rings, kv):
            ring[:, b % ring_blocks, :end - pos] = src[:, pos:end]
    rows, firsts = list(range(num_seqs)), [first] * num_seqs
    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    plan = WindowPlan(empty, empty, torch.tensor(rows, dtype=torch.int32, device=DEV),
                      torch.tensor(firsts, dtype=torch.int32, device=DEV), rows, firsts, ring_blocks)
    return dataclasses.replace(meta, window=plan), rings


def decode_copies(spec: str, keys, values, num_seqs: int, seq_len: int, gen):
    """One format's pages of `keys` / `values` [num_seqs * seq_len, H, D], in as many copies as `copies_for` their
    bytes asks (each on its own shuffled blocks), and each copy's decode metadata: (layers, metas)."""
    layers = [paged_layer(spec, keys, values, num_seqs, seq_len, gen)]
    page_bytes = num_seqs * seq_len * NUM_KV_HEADS * layers[0][0].bytes_per_token_per_head()
    for _ in range(copies_for(page_bytes) - 1):
        layers.append(paged_layer(spec, keys, values, num_seqs, seq_len, gen))
    return layers, [decode_meta(t, seq_len) for _, _, t in layers]


def decode_calls(layers, metas, queries, recent_tokens: int = 0, keys=None, values=None) -> list:
    """One decode call per page copy of `decode_copies` (the queries in turn), for `time_per_call`; with
    `recent_tokens`, each reads its last tokens from a dense recent window of them (`window_for`)."""
    plans = [(m, None) for m in metas]
    if recent_tokens:
        plans = [window_for(t, m.seq_lens_cpu[0], recent_tokens, m, keys, values) for (_, _, t), m in zip(layers, metas)]
    return [lambda q=queries[i % len(queries)], p=p, f=f, m=m, r=r: triton_ops.paged_attention(
        q, p, f, m, scale=SCALE, window=r) for i, ((f, p, _), (m, r)) in enumerate(zip(layers, plans))]


def decode_inputs(num_seqs: int, seq_len: int):
    """A decode shape's random bf16 keys and values [num_seqs * seq_len, H, D], and as many query batches as
    `copies_for` the dense cache's bytes asks: (keys, values, queries, copies)."""
    n = num_seqs * seq_len
    keys = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    values = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    copies = copies_for(n * NUM_KV_HEADS * HEAD_DIM * 2 * 2)
    queries = [torch.randn(num_seqs, NUM_Q_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    return keys, values, queries, copies


def bench_decode(formats, shapes, gen, tiles_for=None, warp_split=False, recent_tokens=0) -> list[dict]:
    rows = []
    for num_seqs, seq_len in shapes:
        n = num_seqs * seq_len
        keys, values, queries, copies = decode_inputs(num_seqs, seq_len)
        sdpa_ms, sdpa_kind, sdpa_all, sdpa_out = sdpa_decode(keys, values, num_seqs, seq_len, queries, copies)
        print(f"decode B={num_seqs} S={seq_len}: sdpa {sdpa_ms * 1e3:.1f} us ({sdpa_kind}; {sdpa_all})", flush=True)
        for spec in formats:
            layers, metas = decode_copies(spec, keys, values, num_seqs, seq_len, gen)
            fmt = layers[0][0]
            page_bytes = n * NUM_KV_HEADS * fmt.bytes_per_token_per_head()
            out = triton_ops.paged_attention(queries[0], layers[0][1], fmt, metas[0], scale=SCALE)
            if spec == "off":
                err = rel_err(out, sdpa_out)
            else:  # against the reference over the same pages, on the first sequences
                k = min(num_seqs, 2)
                sub = decode_meta(layers[0][2][:k], seq_len)
                err = rel_err(out[:k], reference.paged_attention(queries[0][:k], layers[0][1], fmt, sub, scale=SCALE))
            ms = time_per_call(decode_calls(layers, metas, queries))
            row = {"format": spec, "batch": num_seqs, "context": seq_len, "ms": ms, "sdpa_ms": sdpa_ms,
                   "sdpa_kind": sdpa_kind, "sdpa_all_ms": sdpa_all, "speedup_vs_sdpa": sdpa_ms / ms,
                   "time_vs_sdpa": ms / sdpa_ms, "page_bytes": page_bytes, "gbps": page_bytes / ms / 1e6,
                   "bytes_per_token_per_head": fmt.bytes_per_token_per_head(), "rel_err": err}
            if recent_tokens and spec != "off":  # the same pages with the last tokens read exact from a ring
                wms = time_per_call(decode_calls(layers, metas, queries, recent_tokens, keys, values))
                row.update(window_tokens=recent_tokens, window_ms=wms, window_time_vs_sdpa=wms / sdpa_ms)
            if tiles_for is not None and spec in SWEEP_FORMATS:
                row["sweep"] = tiles_for(spec, layers, metas, queries, copies)
            if warp_split:
                row["warp_split"] = warp_split_sweep(spec, layers, metas, queries, copies)
            rows.append(row)
            print(f"  {spec:28s} {ms * 1e3:8.1f} us  {row['gbps']:7.0f} GB/s  x{row['speedup_vs_sdpa']:.2f} vs sdpa"
                  f"  err {err:.1e}", flush=True)
            if "window_ms" in row:   # under its format's line
                print(f"  {'  + window ' + str(recent_tokens):28s} {row['window_ms'] * 1e3:8.1f} us  "
                      f"x{sdpa_ms / row['window_ms']:.2f} vs sdpa", flush=True)
            del layers, metas
            torch.cuda.empty_cache()
        del keys, values, queries
        torch.cuda.empty_cache()
    return rows


# other decode tiles (keys x warps x stages): single- and double-buffered (see pagedkv/ops/triton/tuning.py)
SWEEP_TILES = [TileConfig(16, 64, 4, 2), TileConfig(16, 128, 4, 2), TileConfig(16, 64, 4, 5), TileConfig(16, 64, 4, 8),
               TileConfig(16, 128, 4, 5), TileConfig(16, 32, 4, 5)]


def decode_sweep(spec, layers, metas, queries, copies):
    """Time other tile shapes (and split counts) for one decode case, with the default's own kernel
    (varlen or split-K with the default number of splits)."""
    from pagedkv.ops.triton.tuning import choose_tiles, page_class, plan_attention, split_tiles

    out = {}
    num_seqs = metas[0].block_table.shape[0]
    fmt = layers[0][0]
    group = NUM_Q_HEADS // NUM_KV_HEADS
    calls = lambda fn: [lambda q=queries[i % copies], p=p, f=f, m=m: fn(q, p, f, m)  # noqa: E731
                        for i, ((f, p, _), m) in enumerate(zip(layers, metas))]
    capacity = metas[0].block_table.shape[1] * BLOCK_SIZE
    splits, default = plan_attention(num_seqs, num_seqs, group, HEAD_DIM, fmt, capacity, DEV)
    candidates = [t for t in SWEEP_TILES if t != default]

    def run(tiles, num_splits):
        if num_splits == 1:
            return lambda q, p, f, m: attention.paged_attention(q, p, f, m, scale=SCALE, tiles=tiles)
        return lambda q, p, f, m: split_k.paged_attention(q, p, f, m, scale=SCALE, num_splits=num_splits, tiles=tiles)

    for tiles in candidates:
        key = f"n{tiles.tile_n}_w{tiles.num_warps}_s{tiles.num_stages}" + (f"_split{splits}" if splits > 1 else "")
        try:
            out[key] = time_per_call(calls(run(tiles, splits)))
        except Exception as e:  # noqa: BLE001  (a config that does not fit the GPU's shared memory)
            out[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    for other in sorted({1, 2, 3, 4, max(1, splits // 2), splits * 2} - {splits}):
        tiles = split_tiles(group, HEAD_DIM, page_class(fmt), other) if other > 1 else \
            choose_tiles(num_seqs, num_seqs, group, HEAD_DIM, DEV, pages=page_class(fmt))
        out[f"default_tiles_split{other}"] = time_per_call(calls(run(tiles, other)))
    print("    sweep: " + ", ".join(f"{k} {v * 1e3:.1f} us" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in out.items()), flush=True)
    return out


# warp-split decode kernel configs (`tuning.DecodeTiles`): keys per warp, warps, stages, orientation, register cap
WARP_SPLIT_CONFIGS = [DecodeTiles(16, 4, 1, True, 128, 4), DecodeTiles(32, 4, 1, True, 128, 4),
                      DecodeTiles(16, 2, 1, True, 128, 8), DecodeTiles(32, 2, 1, True, 128, 8),
                      DecodeTiles(16, 1, 1, True, 128, 16), DecodeTiles(32, 1, 1, True, 128, 16)]


def tiles_key(t: DecodeTiles) -> str:
    """A config's name in the results; fields beyond the core ones (an experiment's) when off their default."""
    core = ("tile_n", "num_warps", "num_stages", "transposed", "max_registers", "programs_per_sm")
    extra = "".join(f"_{f.name}{int(getattr(t, f.name))}" for f in dataclasses.fields(t)
                    if f.name not in core and getattr(t, f.name) != f.default)
    return (f"warp_split_n{t.tile_n}_w{t.num_warps}_s{t.num_stages}{'_t' if t.transposed else ''}"
            f"{f'_r{t.max_registers}' if t.max_registers else ''}{extra}")


WARP_SPLIT_COUNTS: dict[int, list[int]] = {}   # batch -> split counts to time (`--warp-split-counts`)


def parse_warp_split_configs(text: str) -> list[DecodeTiles]:
    """'KEYS:WARPS:REGISTERS[:FIELD=INT],...' -> transposed, unpipelined DecodeTiles (programs per SM from the
    register cap; FIELD=INT sets another field, e.g. num_stages=2)."""
    configs = []
    for item in text.split(","):
        fields = item.split(":")
        keys, warps, regs = map(int, fields[:3])
        extra = {name: type(getattr(DecodeTiles, name))(int(value)) for name, value in (f.split("=") for f in fields[3:])}
        configs.append(dataclasses.replace(DecodeTiles(keys, warps, 1, True, regs, max(1, 65536 // (32 * warps * regs))),
                                           **extra))
    return configs


def warp_split_sweep(spec, layers, metas, queries, copies):
    """Time the warp-split decode kernel (`ops/triton/decode.py`) over configs and split counts for one case,
    and the varlen / split-K kernels that served the case before it ("previous_default")."""
    from pagedkv.ops.triton import decode
    from pagedkv.ops.triton.tuning import plan_attention, warp_split_tiles

    fmt = layers[0][0]
    if not decode.is_supported(fmt):
        return {}
    num_seqs = metas[0].block_table.shape[0]
    split_counts = [32, 64] if num_seqs == 1 else [1, 2]
    out = {}
    group = NUM_Q_HEADS // NUM_KV_HEADS
    splits, tiles = plan_attention(num_seqs, num_seqs, group, HEAD_DIM, fmt, metas[0].block_table.shape[1] * BLOCK_SIZE, DEV)
    previous = (lambda q, p, f, m: split_k.paged_attention(q, p, f, m, scale=SCALE, num_splits=splits, tiles=tiles)) \
        if splits > 1 else (lambda q, p, f, m: attention.paged_attention(q, p, f, m, scale=SCALE, tiles=tiles))
    out["previous_default"] = time_per_call([lambda q=queries[i % copies], p=p, f=f, m=m: previous(q, p, f, m)
                                             for i, ((f, p, _), m) in enumerate(zip(layers, metas))])
    k = min(num_seqs, 2)   # the reference output every config is checked against, computed once
    sub = decode_meta(layers[0][2][:k], metas[0].seq_lens_cpu[0])
    ref = reference.paged_attention(queries[0][:k], layers[0][1], fmt, sub, scale=SCALE)
    for tiles in WARP_SPLIT_CONFIGS:
        if tiles != warp_split_tiles(fmt):   # every config is checked on the GPU beside its timing
            out[f"{tiles_key(tiles)}_rel_err"] = rel_err(
                decode.paged_attention(queries[0][:k], layers[0][1], fmt, sub, scale=SCALE, tiles=tiles), ref)
        counts = WARP_SPLIT_COUNTS.get(num_seqs) or {4: split_counts, 2: [64, 128] if num_seqs == 1 else [1, 2, 4]}.get(
            tiles.num_warps, [128, 256] if num_seqs == 1 else [2, 4, 8])
        for splits in counts:
            key = f"{tiles_key(tiles)}_split{splits}"
            fn = lambda q, p, f, m, sp=splits, t=tiles: decode.paged_attention(  # noqa: E731
                q, p, f, m, scale=SCALE, num_splits=sp, tiles=t)
            try:
                out[key] = time_per_call([lambda q=queries[i % copies], p=p, f=f, m=m: fn(q, p, f, m)
                                          for i, ((f, p, _), m) in enumerate(zip(layers, metas))])
            except Exception as e:  # noqa: BLE001  (a config that does not fit)
                out[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    out["rel_err"] = rel_err(decode.paged_attention(queries[0][:k], layers[0][1], fmt, sub, scale=SCALE), ref)
    print("    warp-split: " + ", ".join(f"{k} {v * 1e3:.1f} us" if isinstance(v, float) and not k.endswith("rel_err") else f"{k} {v}"
                                         for k, v in out.items()), flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# prefill
def sdpa_prefill(q, k, v, context):
    """SDPA causal (lower-right aligned when there is context) over contiguous caches; the faster formulation."""
    from torch.nn.attention.bias import causal_lower_right

    group = NUM_Q_HEADS // NUM_KV_HEADS
    candidates = {}
    if context == 0:
        candidates["is_causal_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    candidates["lower_right_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    candidates["lower_right_expanded"] = lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask, scale=SCALE)
    results = {}
    for name, fn in candidates.items():
        try:
            fn()
            results[name] = time_per_call([fn], replays=10)
        except Exception as e:  # noqa: BLE001
            results[name] = None
            print(f"  sdpa prefill {name}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
    best = min((v, k) for k, v in results.items() if v is not None)
    return best[0], best[1], results, candidates[best[1]]()


def bench_prefill(formats, gen, sweep=False, fused=False) -> list[dict]:
    rows = []
    dense_default = tuning.DENSE_PREFILL
    for context in PREFILL_CONTEXTS:
        total = context + PREFILL_CHUNK
        keys = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        values = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        query = torch.randn(PREFILL_CHUNK, NUM_Q_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        q = query.transpose(0, 1).unsqueeze(0)                             # [1, Hq, chunk, D]
        k = keys.transpose(0, 1).unsqueeze(0).contiguous()
        v = values.transpose(0, 1).unsqueeze(0).contiguous()
        sdpa_ms, sdpa_kind, sdpa_all, sdpa_out = sdpa_prefill(q, k, v, context)
        sdpa_out = sdpa_out[0].transpose(0, 1)
        flops = 4 * NUM_Q_HEADS * HEAD_DIM * PREFILL_CHUNK * (context + (PREFILL_CHUNK + 1) / 2)
        print(f"prefill context={context}: sdpa {sdpa_ms:.3f} ms ({sdpa_kind}; {sdpa_all})", flush=True)
        for spec in formats:
            fmt, pages, table = paged_layer(spec, keys, values, 1, total, gen)
            meta = decode_meta(table, total, PREFILL_CHUNK)
            out = triton_ops.paged_attention(query, pages, fmt, meta, scale=SCALE)
            ref = sdpa_out if spec == "off" else reference.paged_attention(query, pages, fmt, meta, scale=SCALE)
            err = rel_err(out, ref)
            ms = time_per_call([lambda: triton_ops.paged_attention(query, pages, fmt, meta, scale=SCALE)], replays=10)
            row = {"format": spec, "context": context, "chunk": PREFILL_CHUNK, "ms": ms, "sdpa_ms": sdpa_ms,
                   "sdpa_kind": sdpa_kind, "sdpa_all_ms": sdpa_all, "speedup_vs_sdpa": sdpa_ms / ms,
                   "tflops": flops / ms / 1e9, "rel_err": err}
            if sweep and spec == "off":
                row["sweep"] = {}
                for tiles in [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)]:
                    key = f"bm{tiles.block_m}_n{tiles.tile_n}_w{tiles.num_warps}_s{tiles.num_stages}"
                    try:
                        row["sweep"][key] = time_per_call([lambda t=tiles: attention.paged_attention(
                            query, pages, fmt, meta, scale=SCALE, tiles=t)], replays=5)
                    except Exception as e:  # noqa: BLE001
                        row["sweep"][key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            if fused and spec != "off":   # the fused kernels (`tuning.DENSE_PREFILL = False`), side by side
                tuning.DENSE_PREFILL = False
                try:
                    fused_out = triton_ops.paged_attention(query, pages, fmt, meta, scale=SCALE)
                    row["fused_prefill_err"] = rel_err(fused_out, ref)
                    row["fused_prefill_ms"] = time_per_call(
                        [lambda: triton_ops.paged_attention(query, pages, fmt, meta, scale=SCALE)], replays=10)
                finally:
                    tuning.DENSE_PREFILL = dense_default
                print(f"  {spec + ' (fused)':28s} {row['fused_prefill_ms']:8.3f} ms  x{sdpa_ms / row['fused_prefill_ms']:.2f}"
                      f" vs sdpa  err {row['fused_prefill_err']:.1e}", flush=True)
            rows.append(row)
            print(f"  {spec:28s} {ms:8.3f} ms  {row['tflops']:6.0f} TFLOP/s  x{row['speedup_vs_sdpa']:.2f} vs sdpa"
                  f"  err {err:.1e}", flush=True)
            del pages
        del keys, values, query, q, k, v
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# writes
def bench_writes(formats, gen) -> list[dict]:
    rows = []
    for num_tokens, label in [(64, "decode"), (PREFILL_CHUNK, "prefill")]:
        for spec in formats:
            fmt = make_format(KVFormat.parse(spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, DEV)
            num_blocks = 4096
            pages = fmt.allocate_pages(num_blocks, BLOCK_SIZE)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens].to(DEV)
            meta = AttentionMetadata(torch.zeros(1, 1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV),
                                     torch.zeros(2, dtype=torch.int32, device=DEV), slots, None, [0], [0, 0], BLOCK_SIZE)
            key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
            value = torch.randn_like(key)
            ms = time_per_call([lambda: triton_ops.write_kv(pages, fmt, key, value, meta)], replays=10)
            rows.append({"format": spec, "phase": label, "tokens": num_tokens, "ms": ms,
                         "ns_per_token": ms * 1e6 / num_tokens})
            print(f"write {label:7s} {spec:28s} {ms * 1e3:8.1f} us  {ms * 1e6 / num_tokens:8.1f} ns/token", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    rows = result["decode"]
    formats = list(dict.fromkeys(r["format"] for r in rows))
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    by = {(r["format"], r["batch"], r["context"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"B={b}\nS={s}" for b, s in shapes]
    for ax, measure in ((axes[0], "time_vs_sdpa"), (axes[1], "gbps")):
        plotting.grouped_bars(ax, labels, {spec: [by[(spec, *shape)][measure] for shape in shapes] for spec in formats})
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_ylabel("decode time / SDPA bf16 time (lower is better)")
    axes[1].axhline(result["copy"]["gbps"], color="k", lw=0.8, ls="--", label="copy bandwidth")
    axes[1].set_ylabel("effective bandwidth, GB/s (page bytes / time)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"pagedkv decode attention, {result['gpu']}, Llama-3-8B heads (32 q / 8 kv / 128)")
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/kernels",
                        help="path without suffix of the .json, .md and .png written; an existing folder: kernels.* in it")
    parser.add_argument("--formats", default=";".join(FORMATS), help="';'-separated format strings")
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile shapes")
    parser.add_argument("--quick", action="store_true", help="two decode shapes, no prefill context 8192")
    parser.add_argument("--warp-split", action="store_true", help="also time the warp-split decode kernel's configs")
    parser.add_argument("--fused-prefill", action="store_true",
                        help="also time prefill over quantized pages through the fused kernels (`tuning.DENSE_PREFILL = "
                             "False`) beside the default, dense scratch pages")
    parser.add_argument("--warp-split-configs", default=None,
                        help="with --warp-split, these transposed configs instead: KEYS:WARPS:REGISTERS,...")
    parser.add_argument("--warp-split-counts", default=None,
                        help="with --warp-split, the split counts to time per batch: BATCH:N,N;BATCH:N,...")
    parser.add_argument("--slot-major", action="store_true",
                        help="pages stored slot-major (the layout before head-major pages), for comparison")
    parser.add_argument("--recent-tokens", type=int, default=0,
                        help="also time decode with a dense recent window of this many tokens (quantized formats)")
    parser.add_argument("--gluon-window", action="store_true",
                        help="decode every format with a dense recent window through the Gluon kernels, at any batch "
                             "(by default: decode_gluon.WINDOW_KERNELS from WINDOW_MIN_TOKENS)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: decode,prefill,write")
    args = parser.parse_args()
    if args.gluon_window:
        from pagedkv.ops.triton import decode_gluon

        decode_gluon.WINDOW_KERNELS, decode_gluon.WINDOW_MIN_TOKENS = tuple(decode_gluon.KERNELS), 0
    for item in filter(None, (args.warp_split_counts or "").split(";")):
        batch, counts = item.split(":")
        WARP_SPLIT_COUNTS[int(batch)] = [int(n) for n in counts.split(",")]
    if args.warp_split_configs:
        global WARP_SPLIT_CONFIGS
        WARP_SPLIT_CONFIGS = parse_warp_split_configs(args.warp_split_configs)
    formats = [f for f in args.formats.split(";") if f]
    skip = set(filter(None, args.skip.split(",")))
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    started = time.time()
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(DEV),
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "command": "python " + " ".join(sys.argv), "shapes": {"num_q_heads": NUM_Q_HEADS,
              "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
              "decode_launch_order": "longest-first" if metadata.LONGEST_FIRST else "grid"}
    warm_up()
    result["copy"] = copy_bandwidth()
    print(f"copy bandwidth: {result['copy']['gbps']:.0f} GB/s (read + write; kernel {result['copy']['kernel_gbps']:.0f}, "
          f"memcpy {result['copy']['memcpy_gbps']:.0f})", flush=True)
    shapes = DECODE_SHAPES[:2] if args.quick else DECODE_SHAPES
    out = Path(args.out)
    if out.is_dir():   # a folder: kernels.{json,md,png} in it
        out = out / "kernels"
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [("decode", lambda: bench_decode(formats, shapes, gen, decode_sweep if args.sweep else None, args.warp_split,
                                                          args.recent_tokens)),
             ("prefill", lambda: bench_prefill(formats, gen, sweep=args.sweep, fused=args.fused_prefill)),
             ("write", lambda: bench_writes(formats, gen))]
    for name, run in parts:
        result[name] = [] if name in skip else run()
        result["targets"] = check_targets(result)
        result["seconds"] = time.time() - started
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))  # kept if a later part fails
    if result["decode"]:
        plot(result, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(markdown(result))
    print_tables(result)


# the decode targets of the kernel issue: time / SDPA bf16 over a contiguous cache, per format at (64, 8192),
# (32, 4096) and (1, 32768)
DECODE_TARGETS = {"off": (1.00, 1.00, 1.00), "q8": (0.65, 0.70, 0.75), "q6": (0.80, 0.85, 0.90),
                  "q4": (0.45, 0.50, 0.60), "turboquant": (0.60, 0.65, 0.75),
                  "turboquant:k=q4_0,v=q4_0": (0.50, 0.55, 0.65)}
TARGETS = [  # (what, format, shape or context, measure, bound): the performance targets for one run
    *[("decode time / SDPA bf16", spec, shape, "time_vs_sdpa", ("<=", bound))
      for spec, bounds in DECODE_TARGETS.items() for shape, bound in zip(((64, 8192), (32, 4096), (1, 32768)), bounds)],
    ("dense prefill speed vs SDPA causal", "off", 0, "speedup_vs_sdpa", (">=", 0.8)),
    *[("prefill time with 8K context / off's", spec, 8192, "time_vs_off", ("<=", 1.25))
      for spec in DECODE_TARGETS if spec != "off"],
]


def check_targets(result: dict) -> list[dict]:
    rows = []
    prefill_off = {r["context"]: r["ms"] for r in result.get("prefill", []) if r["format"] == "off"}
    for what, spec, where, measure, (op, bound) in TARGETS:
        if isinstance(where, tuple):
            match = [r for r in result.get("decode", []) if r["format"] == spec and (r["batch"], r["context"]) == where]
        else:
            match = [r for r in result.get("prefill", []) if r["format"] == spec and r["context"] == where]
        if not match or (measure == "time_vs_off" and where not in prefill_off):
            continue
        r = match[0]
        value = r["ms"] / prefill_off[where] if measure == "time_vs_off" else r[measure]
        ok = value >= bound if op == ">=" else value <= bound
        rows.append({"target": what, "format": spec, "where": list(where) if isinstance(where, tuple) else where,
                     "measured": value, "required": f"{op} {bound}", "met": ok})
    return rows


def markdown(result: dict) -> str:
    """The tables of BENCHMARKS.md's kernel section."""
    copy = result["copy"]["gbps"]
    lines = ["| format | batch | context | time (us) | SDPA bf16 (us) | time / SDPA | GB/s | % of copy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["decode"]:
        lines.append(f"| {r['format']} | {r['batch']} | {r['context']} | {r['ms'] * 1e3:.1f} | {r['sdpa_ms'] * 1e3:.1f} | "
                     f"{r['time_vs_sdpa']:.2f} | {r['gbps']:.0f} | {100 * r['gbps'] / copy:.0f}% |")
    windowed = [r for r in result["decode"] if "window_ms" in r]
    if windowed:
        lines += ["", "| format | batch | context | window | time (us) | with window (us) | window / without | "
                  "time / SDPA with window |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in windowed:
            lines.append(f"| {r['format']} | {r['batch']} | {r['context']} | {r['window_tokens']} | {r['ms'] * 1e3:.1f} | "
                         f"{r['window_ms'] * 1e3:.1f} | {r['window_ms'] / r['ms']:.2f} | {r['window_time_vs_sdpa']:.2f} |")
    lines += ["", "| format | context | chunk | time (ms) | SDPA causal (ms) | speed vs SDPA | TFLOP/s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["prefill"]:
        lines.append(f"| {r['format']} | {r['context']} | {r['chunk']} | {r['ms']:.3f} | {r['sdpa_ms']:.3f} | "
                     f"{r['speedup_vs_sdpa']:.2f} | {r['tflops']:.0f} |")
    fused = [r for r in result["prefill"] if "fused_prefill_ms" in r]
    if fused:   # `--fused-prefill`: the same chunks through the fused kernels
        off = {r["context"]: r["ms"] for r in result["prefill"] if r["format"] == "off"}
        lines += ["", "| format | context | default (ms) | fused (ms) | fused / default | default / off's time |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in fused:
            ratio = f"{r['ms'] / off[r['context']]:.2f}" if r["context"] in off else ""
            lines.append(f"| {r['format']} | {r['context']} | {r['ms']:.3f} | {r['fused_prefill_ms']:.3f} | "
                         f"{r['fused_prefill_ms'] / r['ms']:.2f} | {ratio} |")
    lines += ["", "| format | write_kv, 64 decode tokens (us) | ns/token | 2,048-token chunk (us) | ns/token |",
              "| --- | --- | --- | --- | --- |"]
    by = {(r["format"], r["phase"]): r for r in result["write"]}
    for spec in dict.fromkeys(r["format"] for r in result["write"]):
        d, p = by[(spec, "decode")], by[(spec, "prefill")]
        lines.append(f"| {spec} | {d['ms'] * 1e3:.1f} | {d['ns_per_token']:.1f} | {p['ms'] * 1e3:.1f} | {p['ns_per_token']:.1f} |")
    lines += ["", "| target | format | where | measured | required | |", "| --- | --- | --- | --- | --- | --- |"]
    for t in result.get("targets", []):
        lines.append(f"| {t['target']} | {t['format']} | {t['where']} | {t['measured']:.3f} | {t['required']} | "
                     f"{'met' if t['met'] else '**missed**'} |")
    return "\n".join(lines) + "\n"


def print_tables(result: dict) -> None:
    copy = result["copy"]["gbps"]
    print(f"\n{result['gpu']}  copy {copy:.0f} GB/s  ({result['date']}, torch {result['torch']}, triton {result['triton']})")
    print(f"{'decode':28s} {'B':>4s} {'ctx':>6s} {'us':>8s} {'sdpa us':>8s} {'t/sdpa':>7s} {'GB/s':>6s} {'%copy':>6s}")
    for r in result["decode"]:
        print(f"{r['format']:28s} {r['batch']:4d} {r['context']:6d} {r['ms'] * 1e3:8.1f} {r['sdpa_ms'] * 1e3:8.1f} "
              f"{r['time_vs_sdpa']:7.3f} {r['gbps']:6.0f} {100 * r['gbps'] / copy:5.0f}%")
    print(f"{'prefill':28s} {'ctx':>6s} {'ms':>8s} {'sdpa ms':>8s} {'x sdpa':>7s} {'TFLOP/s':>8s}")
    for r in result["prefill"]:
        print(f"{r['format']:28s} {r['context']:6d} {r['ms']:8.3f} {r['sdpa_ms']:8.3f} {r['speedup_vs_sdpa']:7.2f} {r['tflops']:8.0f}")
    swept = [r for r in result["decode"] if r.get("sweep")]
    if swept:
        print("decode sweep: the default against the fastest alternative timed in this run")
        for r in swept:
            times = {k: v for k, v in r["sweep"].items() if isinstance(v, float)}
            best = min(times, key=times.get) if times else None
            verdict = (f"{best} {times[best] * 1e3:.1f} us ({r['ms'] / times[best]:.2f}x faster)"
                       if best and times[best] < r["ms"] else "the default is fastest")
            print(f"  {r['format']:28s} {r['batch']:4d} {r['context']:6d} default {r['ms'] * 1e3:8.1f} us; {verdict}")
    ws = [r for r in result["decode"] if r.get("warp_split")]
    if ws:
        print("warp-split decode kernel: the fastest config against the default kernel")
        for r in ws:
            times = {k: v for k, v in r["warp_split"].items()
                     if isinstance(v, float) and not k.endswith("rel_err") and k != "previous_default"}
            best = min(times, key=times.get)
            print(f"  {r['format']:12s} {r['batch']:4d} {r['context']:6d} default {r['ms'] * 1e3:8.1f} us "
                  f"(before: {r['warp_split']['previous_default'] * 1e3:.1f}); {best} "
                  f"{times[best] * 1e3:8.1f} us ({r['ms'] / times[best]:.2f}x); time/SDPA {times[best] / r['sdpa_ms']:.3f}"
                  f"  err {r['warp_split']['rel_err']:.1e}")
    print("targets")
    for t in result.get("targets", []):
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']:44s} {t['format']:11s} {str(t['where']):12s} "
              f"{t['measured']:6.3f} (required {t['required']})")


if __name__ == "__main__":
    main()
